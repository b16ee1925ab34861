"""The word-salad bars (data/junk.py SMALL_BITS, SALAD_BITS) calibrated on real text split by source file.

    python bench/junk_bars.py [--quick] [--draws 3] [--seed 0] [--out bench/junk_bars.md]

Real text read offline from this machine, each source's files (its units) split by a seeded hash into a tuning
half and a held-out half: stdlib docstrings (a unit: a module's file), stdlib code, docs/*.md, licences
(/usr/share/common-licenses, site-packages' licence files), /usr/share/doc copyright files and changelogs,
site-packages' METADATA, and a mix of docstrings, docs, licences and METADATA. Each draw takes a half's documents
(1.5 KB pieces at blank lines; a docstring whole) in a seeded order up to a reference size, adds a tenth more
documents of word salad drawn from their own whitespace tokens, and judges all as a run judges its source
(junk.kinds, the documents' own reference): under 100K words by the small-source rule, else the full rule.

Each document is judged three times (VARIANTS), with the bars out of the way, so its word-salad score is counted
against any bar afterwards: before (bigrams.prior a fixed 2), after (the code: Witten-Bell smoothing, the word's
distinct followers, at the small-source rule only) and both (Witten-Bell at both rules). The bars are chosen on the
tuning half only: the highest (most salad caught) under which a variant names no more real documents than the code
before at each reference size of that rule. Real documents named and salad caught are reported on the held-out half.
3-4.5 minutes on 2 shared cores (--quick: ~40 s).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import math
import random
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _garbage_corpus import documents  # noqa: E402
from trimtab.data import bigrams, junk  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OLD = {"small": 0.7, "full": 1.5}  # the bars before the smoothing (SMALL_BITS, SALAD_BITS)
# real words in a reference; with its salad (a tenth more) 85K stays under junk.CORPUS_WORDS, judged by the small rule
SIZES = (5_000, 20_000, 50_000, 85_000, 150_000, 400_000)
QUICK_SIZES = (20_000, 150_000)
GRID = np.round(np.arange(0.1, 2.001, 0.05), 2)  # candidate bars
SALAD = 0.1  # salad documents per real one
MAX_CHARS = 20_000  # longer pieces (a file without blank lines: a table) are left out: junk.alone would judge them
Unit = tuple[str, list[str]]  # (a source file's name, its documents)
HALVES = ("tuning", "held-out")
RULES = ("small", "full")


def _stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "__pycache__"}
    return sorted(p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts))


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return [doc for doc in found if doc and len(doc) >= 300]


def _pieces(path: Path, limit: int = 200_000) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            text = fh.read(limit)
    except (OSError, UnicodeDecodeError, EOFError):
        return []
    return [doc for _, doc in documents(text, path.name)]


def _site_files(pattern: str) -> list[Path]:
    site = Path(sysconfig.get_paths()["purelib"])
    return sorted(p for p in site.glob(pattern) if p.is_file())


def _sources() -> dict[str, Callable[[], Iterator[Unit]]]:
    doc = Path("/usr/share/doc")
    licences = sorted(Path("/usr/share/common-licenses").glob("*")) + _site_files("*.dist-info/LICEN[CS]E*")
    return {
        "docstrings": lambda: ((p.name, _docstrings(p)) for p in _stdlib_files()),
        "code": lambda: ((p.name, _pieces(p)) for p in _stdlib_files()),
        "docs": lambda: ((p.name, _pieces(p)) for p in sorted((ROOT / "docs").glob("*.md"))),
        "licences": lambda: ((str(p), _pieces(p)) for p in licences if p.is_file()),
        "copyright": lambda: ((p.parent.name, _pieces(p)) for p in sorted(doc.glob("*/copyright"))),
        "changelog": lambda: ((str(p), _pieces(p, 40_000)) for p in sorted(doc.glob("*/changelog*"))),
        "metadata": lambda: ((p.parent.name, _pieces(p)) for p in _site_files("*.dist-info/METADATA")),
    }


MIXED = ("docstrings", "docs", "licences", "metadata")


def halves(seed: int) -> dict[str, tuple[list[str], list[str]]]:
    """{source: (tuning documents, held-out documents)}: each unit's documents go to the half its seeded hash
    names, a document seen before (an identical copyright file) nowhere again; "mixed": MIXED's halves together."""
    out, seen = {}, set()
    for name, units in _sources().items():
        split: tuple[list[str], list[str]] = ([], [])
        for unit, docs in units():
            key = hashlib.blake2b(f"{seed}:{name}:{unit}".encode(), digest_size=8).digest()
            fresh = [d for d in docs if d not in seen and junk.MIN_CHARS <= len(d) <= MAX_CHARS]
            seen.update(fresh)
            split[key[0] & 1].extend(fresh)
        out[name] = split
    out["mixed"] = tuple(sum((out[s][h] for s in MIXED), []) for h in (0, 1))  # type: ignore[assignment]
    return out


_CODE = bigrams.prior


def _fixed(c: bigrams._Counts, a: np.ndarray, d: np.ndarray, followers: bool) -> float:
    """The code before: PRIOR at both rules."""
    return bigrams.PRIOR


def _followers(c: bigrams._Counts, a: np.ndarray, d: np.ndarray, followers: bool) -> np.ndarray | float:
    """Witten-Bell smoothing at both rules (the study's patch, not landed at the full rule)."""
    return _CODE(c, a, d, True)


VARIANTS = {"before": _fixed, "after": _CODE, "both": _followers}  # "after": the code as it is


def scores(texts: list[str], prior: Callable) -> np.ndarray:
    """Each document's word-salad score as junk.kinds judges it with no bar in the way (nan: never word salad)."""
    saved = bigrams.prior, junk.SMALL_BITS, junk.SALAD_BITS
    bigrams.prior, junk.SMALL_BITS, junk.SALAD_BITS = prior, math.inf, math.inf
    try:
        verdicts = junk.kinds(texts, mostly=False)
    finally:
        bigrams.prior, junk.SMALL_BITS, junk.SALAD_BITS = saved
    return np.array([v.score if v is not None and v.kind == "word salad" else math.nan for v in verdicts])


def draw(pool: list[str], size: int, rng: random.Random) -> tuple[list[str], list[str]] | None:
    """(real documents up to `size` words, a tenth more of salad of their whitespace tokens); None: too few."""
    order = rng.sample(range(len(pool)), len(pool))
    texts, words = [], 0
    for i in order:
        texts.append(pool[i])
        words += len(junk.words(pool[i]))
        if words >= size:
            break
    if words < size:
        return None
    tokens = " ".join(texts).split()
    n = max(1, round(SALAD * len(texts)))
    salad = [" ".join(rng.sample(tokens, min(len(rng.choice(texts).split()), len(tokens)))) for _ in range(n)]
    return texts, salad


def measure(seed: int, sizes: tuple[int, ...], draws: int, only: set[str] | None) -> list[dict]:
    """One row per source, half, size and draw: its documents' scores by the code before and after."""
    rows = []
    for source, split in halves(seed).items():
        if only and source not in only:
            continue
        for half, pool in zip(HALVES, split):
            for size in sizes:
                for k in range(draws):
                    rng = random.Random(f"{seed}:{source}:{half}:{size}:{k}")
                    drawn = draw(pool, size, rng)
                    if drawn is None:
                        break
                    texts, salad = drawn
                    row = {"source": source, "half": half, "size": size, "draw": k, "real": len(texts)}
                    judged = sum(len(junk.words(t)) for t in texts + salad)  # the reference: the rule judging it
                    row["rule"] = "small" if judged < junk.CORPUS_WORDS else "full"
                    row.update({name: scores(texts + salad, p) for name, p in VARIANTS.items()})
                    rows.append(row)
                    print(f"{source} {half} {size:,} #{k}: {len(texts)} real, {len(salad)} salad", flush=True)
    return rows


def counts(rows: list[dict], variant: str, bar: float) -> tuple[int, int, int, int]:
    """(real named, real, salad caught, salad) over `rows` by `variant` (VARIANTS) at `bar`."""
    real_named = real = caught = salad = 0
    for row in rows:
        named = np.nan_to_num(row[variant], nan=math.inf) < bar
        real_named += int(named[: row["real"]].sum())
        caught += int(named[row["real"] :].sum())
        real += row["real"]
        salad += len(named) - row["real"]
    return real_named, real, caught, salad


def choose(rows: list[dict], rule: str, variant: str) -> float:
    """The highest bar under which `variant` names no more real tuning documents than the code before, at each
    reference size of `rule`."""
    tuning = [r for r in rows if r["half"] == "tuning" and r["rule"] == rule]
    sizes = sorted({r["size"] for r in tuning})
    before = {s: _real(tuning, s, "before", OLD[rule]) for s in sizes}
    allowed = [b for b in GRID if all(_real(tuning, s, variant, b) <= before[s] for s in sizes)]
    return float(max(allowed, default=GRID[0]))


def _real(rows: list[dict], size: int, variant: str, bar: float) -> int:
    return counts([r for r in rows if r["size"] == size], variant, bar)[0]


def _cells(rows: list[dict], bars: dict[str, dict[str, float]], rule: str) -> str:
    found = [counts(rows, v, bars[v][rule]) for v in VARIANTS]
    real = " | ".join(f"{n[0]}/{n[1]:,}" for n in found)
    return real + " | " + " | ".join(f"{n[2]}/{n[3]:,}" for n in found)


def table(rows: list[dict], bars: dict[str, dict[str, float]], half: str) -> list[str]:
    """Markdown rows: per rule, size and source of `half`, real named and salad caught by each variant."""
    names = " | ".join(VARIANTS)
    out = [f"| rule | words | source | real named: {names} | salad caught: {names} |", "|---" * 9 + "|"]
    picked = [r for r in rows if r["half"] == half]
    for rule in RULES:
        for size in sorted({r["size"] for r in picked if r["rule"] == rule}):
            at = [r for r in picked if r["size"] == size]
            for source in [*sorted({r["source"] for r in at}), "all"]:
                these = at if source == "all" else [r for r in at if r["source"] == source]
                name = f"**{source}**" if source == "all" else source
                out.append(f"| {rule} | {size:,} | {name} | {_cells(these, bars, rule)} |")
    return out


def totals(rows: list[dict], bars: dict[str, dict[str, float]], half: str) -> list[str]:
    out = []
    for rule in RULES:
        these = [r for r in rows if r["half"] == half and r["rule"] == rule]
        found = {v: counts(these, v, bars[v][rule]) for v in VARIANTS}
        said = "; ".join(f"{v} {n[0]}/{n[1]:,} real named, {n[2]}/{n[3]:,} salad caught" for v, n in found.items())
        out.append(f"- {half}, {rule} rule: {said}")
    return out


def lowest(rows: list[dict], half: str, variant: str, rule: str, n: int = 6) -> list[str]:
    """The real documents of `half` scoring lowest by `variant` under `rule`: what a bar meets first."""
    found = []
    for row in rows:
        if row["half"] == half and row["rule"] == rule:
            real = row[variant][: row["real"]]
            found += [(float(s), row["source"], row["size"]) for s in real[~np.isnan(real)]]
    return [f"{s:.2f} ({src}, {size:,})" for s, src, size in sorted(found)[:n]]


def report(rows: list[dict], seed: int, draws: int, quick: bool) -> str:
    code = {"small": junk.SMALL_BITS, "full": junk.SALAD_BITS}
    chosen = {v: {rule: choose(rows, rule, v) for rule in RULES} for v in ("after", "both")}
    bars = {"before": OLD, "after": {"small": chosen["after"]["small"], "full": code["full"]}, "both": chosen["both"]}
    lines = [
        f"# Word-salad bars (`bench/junk_bars.py{' --quick' if quick else ''}`, seed {seed}, {draws} draw(s))",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on this machine's own text (Python {sys.version.split()[0]}).",
        "",
        "Variants: before (PRIOR 2 at both rules, SMALL_BITS 0.7, SALAD_BITS 1.5); after (the code: Witten-Bell at the "
        f"small-source rule, SMALL_BITS chosen on the tuning half, SALAD_BITS {code['full']:g}); both (Witten-Bell at "
        "both rules, both bars chosen on the tuning half).",
        "",
        f"Chosen on the tuning half: after SMALL_BITS {chosen['after']['small']:g} (the code: {code['small']:g}); "
        f"both SMALL_BITS {chosen['both']['small']:g}, SALAD_BITS {chosen['both']['full']:g}.",
        "",
        *totals(rows, bars, "tuning"),
        *totals(rows, bars, "held-out"),
        "",
        "Held-out half, each variant at its bars:",
        "",
        *table(rows, bars, "held-out"),
        "",
        *(
            f"- lowest real, held-out, {rule} rule, {v}: {', '.join(lowest(rows, 'held-out', v, rule))}"
            for rule in RULES
            for v in VARIANTS
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, one draw")
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sources", default="", help="comma-separated sources (default: all)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "junk_bars.md"), help="'-': print only")
    args = ap.parse_args()
    sizes, draws = (QUICK_SIZES, 1) if args.quick else (SIZES, args.draws)
    rows = measure(args.seed, sizes, draws, set(filter(None, args.sources.split(","))))
    text = report(rows, args.seed, draws, args.quick)
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
