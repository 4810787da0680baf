"""The docs are checked: every `specdec ...` command in README.md and docs/*.md parses with the CLI's
own parser, and every relative link resolves, so a renamed flag or a moved heading fails CI, not a user.

Commands are taken from fenced code blocks (all but those marked as another language: ```text,
```python, ```json, ...) and parsed as bash would split them: a `$` / `hostA$` prompt, `NAME=value`
prefixes, `\\` continuations, `# comments`, pipes, `&&`, `;` and `$( )` are understood; a command is a
segment that starts with `specdec` (or `python -m cli`). Each one must name a subcommand, use only
flags that subcommand defines (spelled out: no abbreviations), and parse with `build_parser()`;
an upper-case placeholder value (`--port P`, `--model MODEL`) stands for a valid value of its flag,
`[--flag]` is read as `--flag`, and `...` as "and the other flags" (a missing required one is then
allowed). Inline code spans that start with `specdec ` (one line of markdown) are checked for their
subcommand and flag names only, since they are often fragments (`specdec generate --address`).
A flag named alone in inline code (`--no-overlap`, `--tls-cert FILE`, `--compile/--no-compile`)
must be one that some specdec command defines (or a script's, listed in OTHER_FLAGS); placeholders
for flags still to come belong in a `> ` quote, which is not checked.

Links: every `[text](target)` outside code whose target is not a URL must name an existing file
(relative to the document), and an anchor (`file.md#heading`, `#heading`) a heading of that file,
slugged as GitHub does (lowercase, punctuation dropped, spaces to '-', repeats suffixed -1, -2, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.main import build_parser
from specdec.weights.embedded import DEFAULT_ALIAS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 300  # lines: the README is what a newcomer reads; the rest goes to docs/

# Fenced blocks in these languages hold no shell commands (program output, code, data).
NOT_SHELL = {"text", "python", "py", "json", "yaml", "yml", "proto", "protobuf", "toml", "ini", "html", "js"}
SEPARATORS = {"|", "||", "&", "&&", ";", "(", ")", "$(", "`"}
REDIRECTS = {">", ">>", "<", "<<", "&>", ">&"}
PROMPT = re.compile(r"^[\w.@-]*\$$")  # `$`, `hostA$`, `client$`
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
WRAPPERS = {"time", "nohup", "exec", "sudo", "env"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # PROMPT, MODEL, P, N, HEAD_IP
# Flags of other tools that the docs name alone (scripts/trace_overhead.py, scripts/columnar_round.py,
# scripts/replay_drafters.py).
OTHER_FLAGS = {"--endpoint", "--cohorts", "--request-cpu-ms", "--servers", "--split", "--sequences", "--variants"}


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    argv: tuple[str, ...]  # after `specdec`
    inline: bool = False  # from an inline code span: names checked, not a full parse


# ---------------------------------------------------------------- markdown


def fenced_blocks(text: str):
    """(first line number, language, lines) of every fenced code block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i + 2
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        yield start, lang, body
        i += 1


def prose_lines(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*(```+|~~~+)", line)
        if m and fence is None:
            fence = m.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            yield n, line


def without_inline_code(line: str) -> str:
    return re.sub(r"(`+).+?\1", "", line)


# ---------------------------------------------------------------- shell


def tokens(line: str) -> list[str]:
    """bash-like words of one logical line: quotes removed, comments dropped, operators as their own tokens."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def logical_lines(lines: list[str], first: int):
    """(line number, text): continuations (`\\` at the end, or an open quote) joined."""
    i = 0
    while i < len(lines):
        start, text = first + i, lines[i]
        while True:
            if text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i]
                continue
            try:
                tokens(text)
            except ValueError:  # an open quote: the string goes on on the next line
                if i + 1 < len(lines):
                    i += 1
                    text += "\n" + lines[i]
                    continue
            break
        yield start, text
        i += 1


def specdec_argvs(line: str) -> list[list[str]]:
    """The argv (after `specdec`) of every specdec command in one logical shell line."""
    try:
        words = tokens(line)
    except ValueError:  # unbalanced quotes to the end of the block: split plainly
        words = line.split("#", 1)[0].split()
    segments, current = [], []
    for w in words:
        if w in SEPARATORS or set(w) <= set("|&;()`"):
            segments.append(current)
            current = []
        else:
            current.append(w)
    segments.append(current)
    found = []
    for seg in segments:
        while seg and (PROMPT.match(seg[0]) or ASSIGNMENT.match(seg[0]) or seg[0] in WRAPPERS):
            seg = seg[1:]
        if seg[:3] == ["python", "-m", "cli"] or seg[:3] == ["python3", "-m", "cli"]:
            argv = seg[3:]
        elif seg and Path(seg[0]).name == "specdec" and not seg[0].endswith("/"):
            argv = seg[1:]
        else:
            continue
        for j, w in enumerate(argv):  # `cmd > file`, `cmd 2> file`: the command ends there
            if w in REDIRECTS or w[:1] in "<>":
                argv = argv[: j - 1] if j and argv[j - 1] in ("1", "2") else argv[:j]
                break
        found.append(argv)
    return found


def commands_in(text: str, name: str) -> list[Command]:
    found = []
    for first, lang, body in fenced_blocks(text):
        if lang in NOT_SHELL:
            continue
        for n, line in logical_lines(body, first):
            if re.search(r"\bspecdec\b|-m cli\b", line):
                found += [Command(f"{name}:{n}", tuple(argv)) for argv in specdec_argvs(line)]
    for n, line in prose_lines(text):
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            if span.startswith("specdec "):
                found += [Command(f"{name}:{n}", tuple(argv), inline=True) for argv in specdec_argvs(span)]
    return found


def flags_named(text: str, name: str) -> list[tuple[str, str]]:
    """(file:line, flag) of every flag in an inline code span that starts with one, outside quotes."""
    found = []
    for n, line in prose_lines(text):
        if line.lstrip().startswith(">"):  # a placeholder for what is to come
            continue
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            if span.startswith("--"):
                for word in span.split():
                    for part in word.split("/"):
                        if part.startswith("--"):
                            found.append((f"{name}:{n}", part.split("=")[0].rstrip(",.;:)")))
    return found


# ---------------------------------------------------------------- the CLI


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def resolve(argv: list[str]) -> tuple[list[str], argparse.ArgumentParser, list[str]]:
    """(the subcommand words, its parser, the rest); raises KeyError naming an unknown subcommand."""
    parser, path, rest = build_parser(), [], list(argv)
    while (choices := subparsers(parser)) and rest and not rest[0].startswith("-"):
        if rest[0] not in choices:
            raise KeyError(f"`specdec {' '.join([*path, rest[0]])}`: no such command (known: {', '.join(choices)})")
        path.append(rest.pop(0))
        parser = choices[path[-1]]
    if subparsers(parser) and not (rest and rest[0] in ("-h", "--help")):
        raise KeyError(f"`specdec {' '.join(path)}` needs a command: {', '.join(subparsers(parser))}")
    return path, parser, rest


def all_flags(parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Every option string of every specdec command."""
    parser = parser or build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for sub in subparsers(parser).values():
        flags |= all_flags(sub)
    return flags


def normalised(rest: list[str]) -> list[str]:
    """Notation out: `...` dropped, `[--json]` read as `--json`."""
    out = []
    for w in rest:
        if w in ("...", "…"):
            continue
        if w.startswith("[") and w.endswith("]") and len(w) > 2:
            w = w[1:-1]
        out.append(w)
    return out


def check(argv: list[str] | tuple[str, ...], full: bool = True) -> list[str]:
    """What is wrong with `specdec ARGV` (empty: nothing): an unknown command, a flag its parser
    does not define, and (full) anything argparse refuses."""
    try:
        path, parser, rest = resolve(list(argv))
    except KeyError as err:
        return [err.args[0]]
    name = "specdec " + " ".join(path)
    options = {s: a for a in parser._actions for s in a.option_strings}
    errors, args, i = [], [], 0
    elided = any(w in ("...", "…") for w in rest)  # `specdec orchestrator ...`: the required flags left out
    rest = normalised(rest)
    while i < len(rest):
        w = rest[i]
        args.append(w)
        i += 1
        if w == "--":
            args += rest[i:]
            break
        if not w.startswith("-") or re.match(r"^-\d", w):
            continue
        flag, _, inline_value = w.partition("=")
        action = options.get(flag)
        if action is None:
            errors.append(f"`{name}` has no flag {flag}")
            continue
        if action.nargs == 0 or inline_value or i >= len(rest):
            continue
        value = rest[i]
        if PLACEHOLDER.match(value):  # stands for a valid value of this flag
            if action.choices:
                value = str(list(action.choices)[0])
            elif action.type in (int, float):
                value = "1"
            elif action.type is not None:  # the CLI's own types, by name
                value = {
                    "loads": "{}",
                    "port_number": "1",
                    "metrics_base_port": "1",
                    "positive": "1",
                    "non_negative": "1",
                    "host_port": "127.0.0.1:1",
                    "seconds": "1",
                }.get(action.type.__name__, value)
        args.append(value)
        i += 1
    if errors or not full:
        return errors
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exit:
        if exit.code == 0:  # --help
            return []
        lines = stderr.getvalue().strip().splitlines()
        if elided and lines and "the following arguments are required" in lines[-1]:
            return []
        return [f"`{name}` refuses it: {lines[-1] if lines else 'SystemExit'}"]
    return []


# ---------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lowercase, punctuation dropped
    (word characters, '-' and spaces kept), spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a document's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str):
    """(line number, target) of every markdown link and image outside code."""
    for n, line in prose_lines(text):
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", without_inline_code(line)):
            yield n, target
        m = re.match(r"^\s*\[[^\]]+\]:\s*(\S+)", line)  # reference definitions
        if m:
            yield n, m.group(1)


def broken_links(path: Path, text: str | None = None) -> list[str]:
    text = path.read_text() if text is None else text
    errors = []
    for n, target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{n}"
        if not dest.exists():
            errors.append(f"{where}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            errors.append(f"{where}: {target}: no heading #{anchor} in {dest.name}")
    return errors


# ---------------------------------------------------------------- the tests


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_is_short_and_starts_with_demo_and_test():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LIMIT, f"README.md has {len(lines)} lines; move detail to docs/ (limit {README_LIMIT})"
    block = "\n".join(lines[:6])
    assert re.search(r"^```bash\nmake demo\b.*\nmake test\b.*\n```", block, re.M), block
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # the README's test command is what CI runs


def test_the_openai_examples_name_the_model_the_default_pair_serves():
    """`"model": ...` in the docs' HTTP examples is what `specdec serve` lists at GET /v1/models: the
    target as its user named it (Describe's model_name; tests/test_llamacpp_target.py checks the
    llama.cpp target reports the alias, not its file)."""
    found = [
        (doc_id(path), name)
        for path in DOCS
        for name in re.findall(r'(?:\bmodel=|"model":\s*)"([^"]*)"', path.read_text())
    ]
    assert found, "no OpenAI example names a model"
    assert {name for _, name in found} == {DEFAULT_ALIAS}, found


def test_docs_folder_has_the_topics():
    names = {p.name for p in DOCS}
    for topic in ("architecture.md", "performance.md", "adaptive.md", "reliability.md", "gpu.md", "deployment.md"):
        assert topic in names, f"docs/{topic} is missing"


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_every_specdec_command_parses(path):
    found = commands_in(path.read_text(), doc_id(path))
    errors = [f"{c.where}: {err}" for c in found for err in check(c.argv, full=not c.inline)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_every_flag_named_exists(path):
    known = all_flags() | OTHER_FLAGS
    named = flags_named(path.read_text(), doc_id(path))
    errors = [f"{where}: no specdec command has {flag}" for where, flag in named if flag not in known]
    assert not errors, "\n".join(errors)


def test_the_docs_hold_commands_to_check():
    """The extraction finds the commands (a parser that found none would pass everything)."""
    found = [c for p in DOCS for c in commands_in(p.read_text(), doc_id(p)) if not c.inline]
    subcommands = {c.argv[0] for c in found if c.argv}
    assert len(found) >= 30, found
    assert {"generate", "serve", "draft-service", "target-service", "orchestrator", "bench", "ray"} <= subcommands


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_every_relative_link_resolves(path):
    errors = broken_links(path)
    assert not errors, "\n".join(errors)


# ------------------------------------------- the checker itself: it can fail


def test_a_misspelt_flag_fails():
    assert check(["generate", "Hi", "--max-tokens", "32"]) == []
    (err,) = check(["generate", "Hi", "--max-tokns", "32"])
    assert "--max-tokns" in err and "specdec generate" in err
    assert check(["generate", "Hi", "--max-tok", "32"])  # argparse would take the abbreviation; the docs may not
    assert check(["generate", "Hi", "--max-tokns", "32"], full=False)
    assert check(["ray", "up", "--placement", "scatter"])  # a value argparse refuses
    assert check(["ray", "upp"]) and check(["serv", "--port", "1"]) and check(["ray"])
    assert check(["serve", "--port", "P"]) == [] and check(["serve", "--port", "fifty"])
    assert check(["orchestrator", "--port", "1"]) and check(["orchestrator", "--port", "1", "..."]) == []
    assert check(["--help"]) == [] and check(["ray", "up", "--help"]) == []


def test_a_misspelt_flag_named_alone_fails():
    md = "Use `--no-overlap` or `--compile/--no-compile`, `--tls-cert FILE --tls-kee FILE`.\n> `--rule` (to come)\n"
    named = [flag for _, flag in flags_named(md, "x.md")]
    assert named == ["--no-overlap", "--compile", "--no-compile", "--tls-cert", "--tls-kee"]
    assert [f for f in named if f not in all_flags()] == ["--tls-kee"]


def test_a_misspelt_flag_in_markdown_fails():
    md = """# t

```bash
hostA$ specdec orchestrator --port 50051 --draft-address a:1 \\
    --target-adress b:2            # misspelt on the continuation line
```
"""
    (cmd,) = commands_in(md, "x.md")
    assert cmd.where == "x.md:4" and "--target-adress" in cmd.argv
    (err,) = check(cmd.argv)
    assert "--target-adress" in err


def test_extraction_reads_shell_like_bash():
    md = """```bash
$ specdec generate "Hi there" --json | jq .text    # a comment --not-a-flag
SPECDEC_AUTH_TOKEN=$(cat token) OTEL_TRACES_EXPORTER=otlp specdec serve --host 0.0.0.0 && specdec ray status
python -m cli bench compare --quick > out.txt 2> err.txt
curl -sN http://x/v1 -d '{
  "a": "specdec serve --nope"}'
specdec loadtest --requests 4 [--json] ...
```

```text
    specdec     model  0.0  2  10.56
```

Prose: `specdec generate --address` and `specdec.weights.models` and `specdec serve --nope`.
"""
    found = commands_in(md, "x.md")
    assert [c.argv for c in found if not c.inline] == [
        ("generate", "Hi there", "--json"),
        ("serve", "--host", "0.0.0.0"),
        ("ray", "status"),
        ("bench", "compare", "--quick"),
        ("loadtest", "--requests", "4", "[--json]", "..."),
    ]
    assert [c.argv for c in found if c.inline] == [("generate", "--address"), ("serve", "--nope")]
    assert [check(c.argv, full=not c.inline) for c in found][:-1] == [[]] * 6
    assert check(found[-1].argv, full=False)  # the inline --nope


def test_broken_links_fail(tmp_path):
    (tmp_path / "b.md").write_text("# The rule: exact, always\n\n## Setup\n\n## Setup\n")
    good = "[r](b.md#the-rule-exact-always) [s](b.md#setup-1) [t](#top) [u](https://x.org/#q)\n\n# Top\n"
    (tmp_path / "a.md").write_text(good)
    assert broken_links(tmp_path / "a.md") == []
    for bad in ("[x](c.md)", "[x](b.md#the-rule)", "[x](#nowhere)", "[x](b.md#setup-2)"):
        assert broken_links(tmp_path / "a.md", good + bad + "\n"), bad
    assert broken_links(tmp_path / "a.md", "`[x](c.md)`\n```\n[x](c.md)\n```\n") == []  # code is not a link
