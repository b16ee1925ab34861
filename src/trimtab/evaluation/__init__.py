"""Evaluation: perplexity and bits per byte of a text file, and EleutherAI lm-evaluation-harness
tasks through a trimtab adapter (optional dependency), for run directories and Hugging Face
model directories alike."""

from trimtab.evaluation.harness import evaluate
from trimtab.evaluation.perplexity import score_text

__all__ = ["evaluate", "score_text"]
