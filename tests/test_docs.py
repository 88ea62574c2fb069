"""The documents a user reads, checked like code.

- Every relative link and image in README.md and docs/ points at a file that exists, and
  at a heading of that file when it names one (``file.md#anchor``, GitHub's anchors).
- Every ``tiered-kv ...`` command shown in README.md and docs/cli.md exists: ``tiered-kv
  <subcommands> --help`` exits 0 through the installed console script, and its help lists
  every option the example uses.
- No file under README.md, docs/, tiered_kv/, tools/ or tests/ tells the story of how the
  project was built (numbered work periods, borrowed hardware): the project speaks of
  itself in versions, commits, dates, machines and commands. The patterns are assembled
  from parts, so this file can be scanned too.

No network, no GPU; one short subprocess per distinct command.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Markdown files whose links and images must resolve.
LINKED_DOCS = ("README.md", "docs")
#: Markdown files whose ``tiered-kv`` commands must exist.
COMMAND_DOCS = ("README.md", "docs/cli.md")
#: Where narration is looked for.
NARRATION_SCOPE = ("README.md", "docs", "tiered_kv", "tools", "tests")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".json", ".yaml", ".yml", ".cfg", ".ini", ".rst"}


# --- Markdown parsing -------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)(.*)$")


def split_fences(text: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """The text with fenced code blocks blanked out (line numbers kept), and the blocks
    as (info string, lines)."""
    prose, blocks = [], []
    fence, info, block = None, "", []
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, info, block = m.group(1), m.group(2).strip().lower(), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence):
            blocks.append((info, block))
            fence = None
            prose.append("")
        elif fence is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


_INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (letters,
    digits, spaces, hyphens and underscores kept), spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # links keep their text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HTML = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.I)


def broken_links(md: Path, root: Path = REPO) -> list[str]:
    """Relative links and images of ``md`` that do not resolve, as readable lines."""
    prose, _ = split_fences(md.read_text(encoding="utf-8"))
    problems = []
    for lineno, line in enumerate(prose.split("\n"), 1):
        line = _INLINE_CODE.sub("", line)
        targets = _LINK.findall(line) + _REF_DEF.findall(line) + _HTML.findall(line)
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = md if not file_part else (md.parent / file_part).resolve()
            where = f"{md.relative_to(root)}:{lineno}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file {dest}")
            elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def markdown_files(entries: tuple[str, ...], root: Path = REPO) -> list[Path]:
    out = []
    for entry in entries:
        path = root / entry
        out.extend(sorted(path.rglob("*.md")) if path.is_dir() else [path])
    return out


# --- Commands shown in the documents --------------------------------------------------

_SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "zsh"}


def _command_lines(md: Path) -> list[str]:
    """Shell command lines of ``md``: lines of shell blocks, ``$ ``-prompted lines of any
    block (continuations joined), and inline code spans."""
    prose, blocks = split_fences(md.read_text(encoding="utf-8"))
    lines = []
    for info, block in blocks:
        joined, pending = [], ""
        for raw in block:
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            joined.append(pending + raw)
            pending = ""
        for line in joined:
            stripped = line.strip()
            if stripped.startswith("$ "):
                lines.append(stripped[2:])
            elif (info.split() or [""])[0] in _SHELL_BLOCKS and not stripped.startswith("#"):
                lines.append(stripped)
    for _, code in _INLINE_CODE.findall(prose):
        if code.strip().startswith("tiered-kv"):
            lines.append(code.strip())
    return lines


def tiered_kv_invocations(md: Path) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(sub-command path, options used) of every ``tiered-kv`` invocation in ``md``."""
    found = []
    for line in _command_lines(md):
        for segment in re.split(r"\|\||&&|[;|&()]|\$\(", line):
            try:
                tokens = shlex.split(segment, comments=True)
            except ValueError:
                tokens = segment.split()
            while tokens and (re.match(r"^\w+=", tokens[0]) or tokens[0] == "env"):
                tokens.pop(0)
                while tokens and tokens[0] == "-u":  # env -u NAME
                    tokens = tokens[2:]
            if not tokens or Path(tokens[0]).name != "tiered-kv":
                continue
            args = tokens[1:]
            path = []
            while args and re.match(r"^[a-z][a-z0-9_-]*$", args[0]):
                path.append(args.pop(0))
            options = tuple(a.split("=", 1)[0] for a in args if re.match(r"^--?[A-Za-z]", a))
            found.append((tuple(path), options))
    return found


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("tiered-kv")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from tiered_kv.cli import main; sys.argv[0] = 'tiered-kv'; main()"]


@lru_cache(maxsize=None)
def _help(path: tuple[str, ...]) -> tuple[int, str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    proc = subprocess.run([*_cli(), *path, "--help"], capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    return proc.returncode, proc.stdout + proc.stderr


def _documented_commands() -> dict[tuple[str, ...], set[str]]:
    commands: dict[tuple[str, ...], set[str]] = {}
    for md in markdown_files(COMMAND_DOCS):
        for path, options in tiered_kv_invocations(md):
            commands.setdefault(path, set()).update(options)
    return commands


# --- Narration ----------------------------------------------------------------------------

_S = "sess" + "ion"
_LATE_ORD = [
    root + "th" for root in "eleven twelf thirteen fourteen fifteen sixteen seventeen eighteen nineteen twentie".split()
]
_ORD = "first second third fourth fifth sixth seventh eighth ninth tenth".split() + _LATE_ORD
_HW = r"(?:gpu|gpus|h100|h200|a100|b200|machine|hardware|device|card|accelerator)"
_LENT = "le" + "nt"

#: (what it catches, pattern). Each needs the context that makes it narration, so that
#: "every fourth call", scope="session", "a chat session", "silent" and "equivalent" pass.
NARRATION = [
    ("a numbered work period", rf"\b(?:{'|'.join(_ORD)}|\d+(?:st|nd|rd|th))\b(?:[\s-]+[\w']+){{0,2}}?[\s-]+{_S}s?\b"),
    ("a late ordinal", rf"\b(?:{'|'.join(_LATE_ORD)}|twenty-\w+?th|thirtie" + r"th)\b"),
    (
        "a work period named by when it was",
        rf"\b(?:this|that|next|previous|prior|last|earlier|later|same|current|whole)\s+(?:\w+\s+)?{_S}s?\b",
    ),
    ("a work period on some hardware", rf"\b{_HW}\s+{_S}s?\b"),
    ("hardware on loan", rf"\b{_LENT}\s+(?:[\w/]+\s+){{0,2}}?{_HW}\b|\b{_HW}\s+(?:\w+\s+){{0,2}}?{_LENT}\b"),
    ("a work period", r"\bworking\s+" + "peri" + r"ods?\b"),
]
_NARRATION = [(label, re.compile(pattern, re.I)) for label, pattern in NARRATION]


def narration_in(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the words) of every narration in ``text``."""
    hits = []
    for lineno, line in enumerate(text.split("\n"), 1):
        for label, pattern in _NARRATION:
            for m in pattern.finditer(line):
                hits.append((lineno, label, m.group(0)))
    return hits


def scanned_files(root: Path = REPO) -> list[Path]:
    out = []
    for entry in NARRATION_SCOPE:
        path = root / entry
        if path.is_file():
            out.append(path)
            continue
        for f in sorted(path.rglob("*")):
            if f.is_file() and f.suffix in TEXT_SUFFIXES and "__pycache__" not in f.parts:
                out.append(f)
    return out


# --- Tests ---------------------------------------------------------------------------------


def test_relative_links_and_images_resolve():
    problems = [p for md in markdown_files(LINKED_DOCS) for p in broken_links(md)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## GPU <-> CPU copies: `gpu_copy`\n")
    (tmp_path / "a.md").write_text(
        "See [b](docs/b.md#gpu---cpu-copies-gpu_copy) and ![plot](docs/missing.png),\n"
        "[c](docs/b.md#nowhere), [web](https://example.com/x) and `[code](not/checked.md)`.\n"
        "```\n[fenced](not/checked/either.md)\n```\n"
    )
    problems = broken_links(tmp_path / "a.md", root=tmp_path)
    assert len(problems) == 2, problems
    assert "docs/missing.png" in problems[0] and "no such file" in problems[0]
    assert "#nowhere" in problems[1]


def test_github_anchors():
    assert github_slug("GPU <-> CPU") == "gpu---cpu"
    assert github_slug("Worker threads and the GIL: `disk_io`") == "worker-threads-and-the-gil-disk_io"
    assert github_slug("Secondary tier vs vLLM's fs tier") == "secondary-tier-vs-vllms-fs-tier"


def test_the_documents_show_tiered_kv_commands():
    commands = _documented_commands()
    assert ("inspect", "verify") in commands and ("warmup",) in commands, sorted(commands)


@pytest.mark.parametrize("path", sorted(_documented_commands()), ids=lambda p: " ".join(p) or "(top)")
def test_every_documented_command_exists_with_its_options(path):
    rc, out = _help(path)
    assert rc == 0, f"`tiered-kv {' '.join(path)} --help` exited {rc}:\n{out}"
    missing = [
        opt
        for opt in sorted(_documented_commands()[path])
        if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", out)
    ]
    assert not missing, f"`tiered-kv {' '.join(path)}` has no option {missing}; its help:\n{out}"


def test_the_command_check_rejects_a_command_that_does_not_exist():
    rc, _ = _help(("inspect", "no-such-command"))
    assert rc != 0


def test_commands_are_read_from_prompts_shell_blocks_and_inline_code(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "Run `tiered-kv inspect ls PATH --limit 5`.\n\n"
        '```text\n$ env -u PYTHONHASHSEED tiered-kv warmup p.jsonl --model M; echo "exit $?"\n'
        "                 tiered-kv demo\n```\n"
        "```bash\ntiered-kv config --tp 4 \\\n  -o out.json | tee log\n# tiered-kv clear\n```\n"
    )
    assert sorted(tiered_kv_invocations(md)) == [
        (("config",), ("--tp", "-o")),
        (("inspect", "ls"), ("--limit",)),
        (("warmup",), ("--model",)),
    ]


def test_no_narration_of_how_the_project_was_made():
    hits = []
    for f in scanned_files():
        for lineno, label, words in narration_in(f.read_text(encoding="utf-8", errors="replace")):
            hits.append(f"{f.relative_to(REPO)}:{lineno}: {label}: {words!r}")
    assert not hits, "narration found (say versions, commits, dates, machines):\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "text",
    [
        "the " + _ORD[14] + " " + _S + " measured it",
        " ".join((_LENT, "H100")),
        " ".join(("GPU", _LENT)),
        "the first GPU " + _S + " found it",
        "this " + _S + "'s code",
        "the " + _ORD[11] + " and " + _ORD[16] + " ones",
        "in the 12th " + _S,
        "a GPU " + _S,
    ],
)
def test_the_narration_patterns_catch(text):
    assert narration_in(text), text


@pytest.mark.parametrize(
    "text",
    [
        '@pytest.fixture(scope="' + _S + '")',
        "every fourth call reads the log",
        "the first call of a request",
        "a second run, the third column",
        "a chat " + _S + " of many turns",
        "boto3." + _S[0].upper() + _S[1:] + "()",
        "a silent failure is equivalent to a miss",
        "datetime.date.today().isoformat()",
        "every block was used within the last week",
    ],
)
def test_the_narration_patterns_let_pass(text):
    assert not narration_in(text), narration_in(text)
