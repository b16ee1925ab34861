"""The docs/ pages as a newcomer reads them: every config key, command-line flag, `trimtab ctl` verb,
action and `file.py:symbol` they name exists, and a journal line they quote uses the journal's words.
Source checks only (no training), so a renamed key or flag fails here rather than in a reader's shell."""

import argparse
import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

import pytest

from trimtab.cli import build_parser
from trimtab.config import RunConfig
from trimtab.errors import TrimtabError
from trimtab.orchestrator.fault_specs import parse_faults
from trimtab.training.actions import ACTIONS, COMMANDS

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "trimtab"
DOCS = sorted((REPO / "docs").glob("*.md"))
SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))
FILE_SUFFIXES = (".py", ".md", ".json", ".jsonl", ".yaml", ".pt", ".safetensors", ".txt", ".html", ".npz", ".bin")


def _lines():
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.name}:{number}", line


def _is_config_key(dotted: str) -> bool:
    """A key of the run config (a `section.*` wildcard names every key under a section object)."""
    node = RunConfig()
    for part in dotted.removesuffix(".*").split("."):
        if isinstance(node, dict):
            return True  # a free-form mapping (a mixture's entries, faults): its keys are the user's
        if part.endswith("*"):  # `orchestrator.rl_*`: the keys that begin so
            return any(name.startswith(part[:-1]) for name in vars(node))
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False  # a method of the section (`train.validate`) is no key either
        node = getattr(node, part)
    return True


def _is_module_name(dotted: str) -> bool:
    """`checkpoint.write_error`, `distributed.tensor`: a module or function of trimtab, not a key."""
    head, _, rest = dotted.partition(".")
    if _is_config_key(f"{head}.{rest.split('.')[0]}"):
        return False  # `model.moe.x`: under a config section, not the module model/moe.py
    module = SRC / head
    if (module / f"{rest.split('.')[0]}.py").is_file():
        return True
    source = module.with_suffix(".py") if module.with_suffix(".py").is_file() else module / "__init__.py"
    if not source.is_file():
        return False
    text = source.read_text()
    return re.search(rf"^(?:def|class) {re.escape(rest.split('.')[0])}\b", text, re.MULTILINE) is not None


def test_every_config_key_the_docs_name_exists():
    """`orchestrator.data.watch_steps` written `data.watch_steps` sends a reader's `--set` to an unknown key."""
    key = re.compile(rf"`((?:{'|'.join(SECTIONS)})(?:\.(?:[a-z_][a-z0-9_]*\*?|\*))+)")
    bad = [
        f"{where}: {dotted}"
        for where, line in _lines()
        if "did you mean" not in line  # an unknown key shown with the error it gets
        for dotted in key.findall(line)
        if not dotted.endswith(FILE_SUFFIXES) and not _is_config_key(dotted) and not _is_module_name(dotted)
    ]
    assert bad == []


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found |= {f"{name} {inner}": p for inner, p in _subparsers(sub).items()}
    return found


def _commands():
    """Each `trimtab SUB ...` command line in the docs, continuation lines joined, comments cut."""
    for path in DOCS:
        lines, start = path.read_text().splitlines(), 0
        for number, line in enumerate(lines, 1):
            if line.endswith("\\"):  # continued on the next line: read as one, named by its first
                continue
            line = " ".join(part.rstrip("\\") for part in lines[start:number])
            number, start = start + 1, number
            for span in re.findall(r"`([^`]*)`", line) if "`" in line else [line]:
                for match in re.finditer(r"\btrimtab ([a-z]+(?: prepare)?)\b([^#|;`]*)", span):
                    yield f"{path.name}:{number}", match.group(1), match.group(2)


def test_every_flag_the_docs_give_a_subcommand_exists():
    """`-m trimtab train --config run.yaml` fails (the config file is positional)."""
    parsers = _subparsers(build_parser())
    bad = []
    for where, name, rest in _commands():
        if name not in parsers or name == "bench":  # bench passes its arguments to the benchmark's own parser
            continue
        known = {flag for action in parsers[name]._actions for flag in action.option_strings}
        flags = re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", rest)
        bad += [f"{where}: trimtab {name} {flag}" for flag in flags if flag not in known]
    assert bad == []


def test_every_ctl_verb_and_action_the_docs_name_exists():
    """`ctl save` (the verb is `checkpoint`) and `adjust_mod_capacity(...)` (the action is
    `set_mod_capacity`) are refused by `trimtab ctl` and the action table."""
    verbs = {action.usage().split()[0] for action in [*ACTIONS.values(), *COMMANDS.values()]}
    verb = re.compile(r"`(?:trimtab )?ctl (?:--queue )?(?:RUN(?:_DIR)? |STUDY_DIR/\S+ |runs/\S+ )?([a-z][a-z0-9-]*)")
    action = re.compile(r"`((?:set|adjust)_[a-z_]+)\(")
    bad = [f"{where}: ctl {v}" for where, line in _lines() for v in verb.findall(line) if v not in verbs]
    bad += [f"{where}: {a}" for where, line in _lines() for a in action.findall(line) if a not in ACTIONS]
    assert bad == []


@pytest.mark.parametrize("page", [p.name for p in DOCS])
def test_every_file_and_symbol_a_page_names_exists(page):
    """`core.py:memory_fraction` when it lives in `readings.py` sends a reader to the wrong file."""
    files = {p.relative_to(SRC).as_posix(): p for p in SRC.rglob("*.py")}
    bad = []
    for number, line in enumerate((REPO / "docs" / page).read_text().splitlines(), 1):
        for path, symbol in re.findall(r"`([\w/]+\.py):(\w+)", line):
            texts = [p.read_text() for rel, p in files.items() if rel == path or rel.endswith("/" + path)]
            defined = rf"^\s*(?:def|class) {symbol}\b|^\s*{symbol}\s*[:=]"
            if not any(re.search(defined, text, re.MULTILINE) for text in texts):
                bad.append(f"{page}:{number}: {path}:{symbol}")
    assert bad == []


def test_a_quoted_journal_line_uses_the_journals_words():
    """The console and journal say `run length 69 steps`, not `set total steps (steps=69)`: a quoted
    line with an action's generic words is one the code no longer prints."""
    # an action of the table is described by its own words; the generic "name (k=v)" is for others
    generic = [name.replace("_", " ") for name, a in ACTIONS.items() if a.says != name.replace("_", " ")]
    arrow = re.compile(r"\[orchestrator\].* -> ([a-z][a-z ]+)")
    bad = [
        f"{where}: {words}"
        for where, line in _lines()
        for words in arrow.findall(line)
        if any(words.startswith(g) for g in generic)
    ]
    assert bad == []


def _example_command_lines():
    """Each example command line of the README and the docs (an indented `trimtab ...`, `torchrun ...
    -m trimtab ...` or `$ trimtab ...` line, continuations joined), from `trimtab`'s subcommand on;
    synopses with `[optional]` parts or `...` left out."""
    for path in [REPO / "README.md", *DOCS]:
        lines, pending = path.read_text().splitlines(), ""
        for number, line in enumerate(lines, 1):
            if not pending and not line.startswith("    "):
                continue
            pending += line.strip().removesuffix("\\") + " "
            if line.endswith("\\"):
                continue
            text, pending = pending.split(" | ")[0], ""
            match = re.match(r"(?:\$ )?(?:torchrun .*?-m )?trimtab ([a-z].*)", text)
            if match and "[" not in match.group(1) and "..." not in match.group(1):
                yield f"{path.name}:{number}", shlex.split(match.group(1), comments=True)


def test_every_example_command_parses_with_valid_keys_and_faults():
    """Flag names alone pass `--set train.max_step=40`, `--inject nan@30` or a flag given a value it
    takes none of: each example is parsed as the CLI parses it (as a reader's shell splits it), its
    `--set` keys looked up in the config and its `--inject` faults read."""
    parser, bad = build_parser(), []
    for where, argv in _example_command_lines():
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                args = parser.parse_args(argv)
            parse_faults(getattr(args, "inject", None) or [])
        except SystemExit:
            bad.append(f"{where}: {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1:]}")
            continue
        except TrimtabError as exc:
            bad.append(f"{where}: {' '.join(argv)}: {exc}")
        keys = [s.partition("=")[0] for s in getattr(args, "set", None) or []]
        bad += [f"{where}: --set {key}: no such config key" for key in keys if not _is_config_key(key)]
    assert bad == []
