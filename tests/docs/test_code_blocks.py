"""Every fenced code block of README.md, CONTRIBUTING.md, docs/*.md and examples/*.md runs here, or says why not.

A block is marked by an HTML comment on the line right before its opening fence (invisible on GitHub; the format is
documented in CONTRIBUTING.md):

    <!-- run -->              python: executed in a fresh process; bash: every line is one command, executed
    <!-- run: torchrun N -->  python: executed on N gloo ranks (python -m torch.distributed.run --standalone)
    <!-- file: PATH -->       the block is the repository's file PATH, byte for byte
    <!-- output: COMMAND -->  what COMMAND prints; compared with the real output when a run block of the page runs it
    <!-- fragment: REASON --> not executed; REASON (mandatory) says what the block assumes

Commands of a bash run block: ``torchrun``, ``zero-buffers`` and ``python`` run with this interpreter
(``-m torch.distributed.run``, ``-m zero_buffers.cli``), in a temporary folder holding a link to ``examples/``; each
must exit 0, or the status its comment names (``# ... (exit status 1)``). Every ``examples/*.py`` must be shown by a
``file:`` block and run by a run block.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_EXAMPLE = "examples/bn_divergence.py"
README_EXAMPLE_COMMAND = "torchrun --nproc_per_node 2 examples/bn_divergence.py"
CI_COMMAND = ('python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt torch==2.13.0 -e ".[test]" '
              '&& .venv/bin/python -m pytest -q')
COMMAND_TIMEOUT_S = 180
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>[a-z]+)\s*(?::(?P<text>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
KINDS = ("run", "file", "output", "fragment")
PROGRAMS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
            "zero-buffers": [sys.executable, "-m", "zero_buffers.cli"],
            "python": [sys.executable], "python3": [sys.executable]}


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its marker (kind, text) and its content."""

    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    kind: str | None  # None: no marker
    text: str  # the marker's text after the colon ("" when none)
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").glob("*.md"))]
    return [p for p in found if p.is_file()]


def parse(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown page, each with the marker on the line before its fence (if any)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        body = [line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[i + 1:end]]
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        blocks.append(Block(page=str(path.relative_to(ROOT)), line=i + 1, lang=m["info"].strip().split(" ")[0],
                            kind=marker["kind"] if marker else None,
                            text=(marker["text"] or "").strip() if marker else "",
                            code="\n".join(body) + "\n"))
        i = end + 1
    return blocks


BLOCKS = [b for p in pages() for b in parse(p)]
RUN_PYTHON = [b for b in BLOCKS if b.kind == "run" and b.lang == "python"]
RUN_COMMANDS = [b for b in BLOCKS if b.kind == "run" and b.lang in ("bash", "sh", "console")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return env


def _workdir(tmp: Path) -> Path:
    """A fresh folder to run commands in: whatever they write stays out of the repository; ``examples/`` is there."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return tmp


@dataclass(frozen=True)
class Command:
    line: str  # as written, without its comment
    argv: list[str]
    expected: int


def commands(block: Block) -> list[Command]:
    """Each non-empty line of a bash run block, the program mapped to this interpreter, with its expected status."""
    out = []
    for raw in block.code.splitlines():
        words = shlex.split(raw, comments=True)
        if not words:
            continue
        program = PROGRAMS.get(words[0])
        assert program, (f"{block.id}: a run block may run only {', '.join(PROGRAMS)}, not {words[0]!r} "
                         f"(mark the block '<!-- fragment: why -->' instead)")
        status = re.search(r"#.*exit status (\d+)", raw)
        out.append(Command(" ".join(words), program + words[1:], int(status[1]) if status else 0))
    return out


def cli_subcommands() -> set[str]:
    """The subcommands ``zero-buffers`` has in this checkout, from its parser definitions."""
    return set(re.findall(r"add_parser\(\s*[\"']([\w-]+)[\"']", (ROOT / "zero_buffers" / "cli.py").read_text()))


_command_results: dict[str, list[tuple[Command, subprocess.CompletedProcess]]] = {}


def run_command_block(block: Block, tmp: Path) -> list[tuple[Command, subprocess.CompletedProcess]]:
    """Run the block's commands in order (once per session); the first unexpected exit status fails the test."""
    if block.id in _command_results:
        return _command_results[block.id]
    cmds = commands(block)
    missing = sorted({c.argv[3] for c in cmds if c.argv[:3] == PROGRAMS["zero-buffers"] and len(c.argv) > 3}
                     - cli_subcommands())
    if missing:
        pytest.skip(f"{block.id}: zero-buffers has no {', '.join(missing)} command in this checkout")
    cwd, done = _workdir(tmp), []
    for c in cmds:
        proc = subprocess.run(c.argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        assert proc.returncode == c.expected, (
            f"{block.id}: `{c.line}` exited {proc.returncode}, expected {c.expected}\n--- stdout\n{proc.stdout[-3000:]}"
            f"\n--- stderr\n{proc.stderr[-3000:]}")
        done.append((c, proc))
    _command_results[block.id] = done
    return done


_RUNNER = textwrap.dedent("""
    import json, sys, traceback
    for path in sys.argv[1:]:
        source = open(path).read()
        try:
            exec(compile(source, path, "exec"), {"__name__": "__main__"})
            print(json.dumps({"path": path, "ok": True}), flush=True)
        except BaseException:
            print(json.dumps({"path": path, "ok": False, "error": traceback.format_exc()}), flush=True)
""")


@pytest.fixture(scope="module")
def python_results(tmp_path_factory) -> dict[str, dict]:
    """Every single-process python run block, each in a fresh namespace, all in one fresh interpreter (one start-up of
    torch for all of them; what one block registers globally the next ones see)."""
    tmp = _workdir(tmp_path_factory.mktemp("python_blocks"))
    files = {}
    for n, block in enumerate(b for b in RUN_PYTHON if not b.text):
        path = tmp / f"block{n}_{Path(block.page).stem}_line{block.line}.py"
        path.write_text(block.code)
        files[str(path)] = block.id
    if not files:
        return {}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, *files], cwd=tmp, env=_env(), capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"path"'):
            row = json.loads(line)
            results[files[row["path"]]] = row
    for block_id in files.values():
        results.setdefault(block_id, {"ok": False, "error": f"the runner died (exit {proc.returncode}) before the "
                                                            f"block finished\n{proc.stderr[-3000:]}"})
    return results


def skeleton(text: str) -> list[str]:
    """Output lines with every number replaced by '#' and runs of spaces by one: what must not change when a float
    moves in its last digits on another machine."""
    number = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|\binf\b|\bnan\b"
    return [re.sub(r"\s+", " ", re.sub(number, "#", line)).strip() for line in text.strip().splitlines()]


# ---------------------------------------------------------------------------------------------------- the markers


def test_every_code_block_is_marked_run_file_output_or_fragment():
    unmarked = [f"{b.id} ({b.lang or 'no language'}): {b.code.splitlines()[0] if b.code.strip() else ''}"
                for b in BLOCKS if b.kind is None]
    assert not unmarked, ("code blocks without a marker on the line before the fence (<!-- run -->, "
                          "<!-- fragment: why -->, ... see CONTRIBUTING.md):\n" + "\n".join(unmarked))


def test_every_marker_is_known_and_says_what_it_needs():
    bad = []
    for b in BLOCKS:
        if b.kind is None:
            continue
        if b.kind not in KINDS:
            bad.append(f"{b.id}: unknown marker {b.kind!r} (one of {', '.join(KINDS)})")
        elif b.kind == "fragment" and not b.text:
            bad.append(f"{b.id}: a fragment marker needs its reason: <!-- fragment: what it assumes -->")
        elif b.kind == "output" and not b.text:
            bad.append(f"{b.id}: an output marker names the command that printed it: <!-- output: COMMAND -->")
        elif b.kind == "file" and not (ROOT / b.text).is_file():
            bad.append(f"{b.id}: <!-- file: {b.text} --> names no file of the repository")
        elif b.kind == "run" and b.lang == "python" and b.text and not re.fullmatch(r"torchrun [1-9]", b.text):
            bad.append(f"{b.id}: a python run marker is <!-- run --> or <!-- run: torchrun N -->, not {b.text!r}")
        elif b.kind == "run" and b.lang not in ("python", "bash", "sh", "console"):
            bad.append(f"{b.id}: only python and bash blocks can run, not {b.lang or 'a block without a language'!r}")
    assert not bad, "\n".join(bad)


def test_file_blocks_equal_their_files_and_every_example_is_shown_and_run():
    for b in (b for b in BLOCKS if b.kind == "file"):
        assert b.code == (ROOT / b.text).read_text(), f"{b.id}: the block differs from {b.text}; paste the file again"
    shown = {b.text for b in BLOCKS if b.kind == "file"}
    run = " ".join(c.line for b in RUN_COMMANDS for c in commands(b))
    for example in sorted((ROOT / "examples").glob("*.py")):
        name = str(example.relative_to(ROOT))
        assert name in shown, f"{name} is shown by no <!-- file: {name} --> block"
        assert name in run, f"{name} is run by no <!-- run --> command block"


def test_readme_command_2_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert CI_COMMAND in readme, "README's command 2 changed: .ci/run step 1 runs it and says so"
    ci = (ROOT / ".ci" / "run").read_text()
    assert CI_COMMAND.replace(" && .venv/bin/python -m pytest -q", "") in ci and ".venv/bin/python -m pytest -q" in ci


# ------------------------------------------------------------------------------------------------- the run blocks


@pytest.mark.parametrize("block", RUN_PYTHON, ids=[b.id for b in RUN_PYTHON])
def test_python_block_runs(block, python_results, tmp_path):
    if block.text:  # torchrun N
        nproc = int(block.text.split()[1])
        path = _workdir(tmp_path) / f"{Path(block.page).stem}_line{block.line}.py"
        path.write_text(block.code)
        proc = subprocess.run(PROGRAMS["torchrun"] + ["--standalone", f"--nproc-per-node={nproc}", str(path)],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        assert proc.returncode == 0, (f"{block.id} failed on {nproc} ranks (exit {proc.returncode})\n--- stdout\n"
                                      f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}")
    else:
        result = python_results[block.id]
        assert result["ok"], f"{block.id} raised:\n{result['error']}"


@pytest.mark.parametrize("block", RUN_COMMANDS, ids=[b.id for b in RUN_COMMANDS])
def test_command_block_runs_and_its_shown_output_is_what_it_prints(block, tmp_path):
    done = run_command_block(block, tmp_path)
    shown = {b.text: b for b in BLOCKS if b.kind == "output" and b.page == block.page}
    for c, proc in done:
        if c.line in shown:
            assert skeleton(proc.stdout) == skeleton(shown[c.line].code), (
                f"{shown[c.line].id}: the output shown for `{c.line}` is not what it prints now; paste this:\n"
                f"{proc.stdout}")


def test_readme_example_runs_as_printed_and_shows_the_bug_then_the_fix(tmp_path):
    readme = [b for b in BLOCKS if b.page == "README.md"]
    shown = [b for b in readme if b.kind == "file" and b.text == README_EXAMPLE]
    assert shown and shown[0].lang == "python", f"README.md shows {README_EXAMPLE} in no <!-- file: --> block"
    assert shown[0].code == (ROOT / README_EXAMPLE).read_bytes().decode(), f"README's example is not {README_EXAMPLE}"
    launch = [b for b in readme if b.kind == "run" and b in RUN_COMMANDS
              and any(c.line == README_EXAMPLE_COMMAND for c in commands(b))]
    assert launch, f"README.md runs the example with no `{README_EXAMPLE_COMMAND}` line in a <!-- run --> block"
    done = run_command_block(launch[0], tmp_path)
    out = next(proc.stdout for c, proc in done if c.line == README_EXAMPLE_COMMAND)
    bug, fix = out.index("BUG:"), out.index("FIX:")
    assert bug < fix, out
    bug_rows = out[bug:fix].splitlines()[2:]
    assert any("running_mean" in r and " NO " in r for r in bug_rows), f"no differing running_mean first:\n{out}"
    assert "FIX: 0 of 3 buffers differ" in out[fix:] and " NO " not in out[fix:], f"still differing after:\n{out}"
    assert [b for b in readme if b.kind == "output" and b.text == README_EXAMPLE_COMMAND], \
        "README.md does not show what the example prints (<!-- output: the command -->)"


# ---------------------------------------------------------------------------------------- links and stale words

STALE = [r"\bissue \d+", r"\bthis round\b", r"\bnext (?:session|round)\b", r"\bCONTEXT\.md\b", r"/work/",
         r"\b\d+\.\d+ promises\b", r"\bfirst draft\b", r"\bwas lent\b"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        m = re.match(r"^#{1,6} (.+)$", line)
        if m and not in_code:
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose(path: Path) -> str:
    """A page without its code blocks."""
    out, in_code = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            out.append(line)
    return "\n".join(out)


def test_links_point_to_files_and_headings_that_exist():
    repo_md = {p.name for p in ROOT.rglob("*.md") if not {".git", ".venv", ".venv-oldest", ".venv-next"} & set(p.parts)}
    broken = []
    for page in pages():
        text = prose(page)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://|^mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: ({target}): no file {file}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: ({target}): {dest.name} has no heading #{anchor}")
        for name in re.findall(r"`([^`\s*]+\.md)`", text):
            if not (ROOT / name).exists() and Path(name).name not in repo_md:
                broken.append(f"{page.relative_to(ROOT)}: `{name}` is no file of the repository")
    assert not broken, "\n".join(broken)


def test_docs_hold_no_words_that_go_stale():
    found = []
    for page in pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            found += [f"{page.relative_to(ROOT)}:{n}: {pattern!r} in: {line.strip()[:100]}"
                      for pattern in STALE if re.search(pattern, line, re.I)]
    assert not found, ("planning words, versions in promises or files outside the repository (history goes to "
                       "CHANGELOG.md):\n" + "\n".join(found))
