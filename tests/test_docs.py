"""The Markdown documents against the code: their commands parse, their links resolve, the
configuration table is ``HiLoReConfig``'s, and every NOTE they name exists.

Documents: ``README.md``, ``examples/README.md``, ``examples/*/README.md``,
``ds_configs/README.md`` and ``ds_hilore/README.md`` (those that exist). Every failure names the
document and the line.

Parsing rules:

* Commands (``test_commands_parse``). Fenced code blocks whose info string is ``bash``, ``sh``,
  ``shell``, ``console`` or empty are read line by line: a trailing backslash continues a line,
  a quote left open continues it too, a leading ``$ `` prompt is dropped, ``#`` starts a comment,
  and ``&&``, ``||``, ``;``, ``|`` and ``&`` separate commands. In each command, leading
  ``NAME=value`` assignments and ``env`` / ``time`` / ``nohup`` are dropped, then launcher
  prefixes are stripped to the script part: ``deepspeed ...`` through DeepSpeed's own launcher
  parser (``--module X`` runs module X); ``mpirun`` / ``mpiexec`` up to the interpreter or the
  script; ``accelerate launch`` and ``torchrun`` up to ``-m MODULE`` or the first ``*.py``.
  An interpreter (``python``, ``python3``, ``.venv/bin/python``, ...) drops its own options up
  to ``-m MODULE`` or the script. What remains is checked when it is one of these entry points:

  - ``hilore ...`` (also ``.venv/bin/hilore``) and ``python -m ds_hilore.cli ...``:
    ``ds_hilore.cli.build_parser().parse_args(argv)``;
  - ``python -m ds_hilore.run ...``: ``ds_hilore.run.parse(argv)``, then what it runs, by the
    rules here (a script outside the repository, such as ``train.py``, is not checked);
  - ``python -m examples.<module> ...`` and a script inside the repository
    (``examples/grpo_minimal.py``, imported as the module of that path): the module's
    ``build_parser()`` parses ``argv``; without one, its ``parse_args()`` runs with ``sys.argv``
    set to the command and stops right after argparse parsed it (nothing the module does after
    parsing runs; arguments it hands on through ``parse_known_args`` are not checked).

  Anything else (``make``, ``pip``, ``export``, ``ray``, other modules) is skipped. ``--help``
  and ``-h`` pass.
* Links (``test_links_resolve``). Outside fenced blocks: every ``[text](target)`` and
  ``![text](target)`` whose target is not a URL (``scheme:``) or a bare ``#anchor`` must name an
  existing file or folder, relative to the document (``#anchor`` and ``?query`` dropped). Every
  inline code span that is a relative path with a ``/`` and a file extension (or a trailing
  ``/``) must exist relative to the repository root or to the document; paths under a folder
  that ``.gitignore`` ignores (``output/``, ``.venv/``, ...) are not checked.
* The configuration table (``test_config_table_is_hilore_config``). In
  ``ds_configs/README.md``, the table whose header is ``key | type | default | meaning`` must
  have one row per field of ``HiLoReConfig``, no other row, the field's default in the default
  column (one code span, read as JSON), and for a field with a fixed set of values each value
  (as JSON) in its row.
* NOTEs (``test_notes_exist``, ``test_note_index_is_complete``). Every ``NOTE [ name ]`` in a
  document (whitespace, line breaks included, counts as one space) must be a NOTE defined under
  ``ds_hilore/`` or ``tests/``. A NOTE is defined where a line holds ``NOTE [ name ]`` alone
  after ``#`` or ``\"\"\"``, or, for a name with no such line anywhere, where a comment line
  starts with ``# NOTE [ name ]:``. The table under ``## Index of the NOTEs`` in
  ``ds_hilore/README.md`` must list every NOTE defined under ``ds_hilore/`` once, with the file
  that defines it (relative to ``ds_hilore/``, in a code span), and nothing else.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted({ROOT / "README.md", ROOT / "examples" / "README.md",
                    *ROOT.glob("examples/*/README.md"), ROOT / "ds_configs" / "README.md",
                    ROOT / "ds_hilore" / "README.md"})
SHELL_INFO = {"", "bash", "sh", "shell", "console", "zsh"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
PATH_EXTENSIONS = {"py", "json", "jsonl", "md", "sh", "ini", "txt", "cfg", "toml", "yaml", "yml",
                   "png", "pth"}
NOTE_INDEX_HEADING = "## Index of the NOTEs"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _existing_documents() -> list:
    return [pytest.param(path, id=_rel(path)) for path in DOCUMENTS if path.is_file()]


# ---------------------------------------------------------------------------------- Markdown
def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(info string, line number of the block's first content line, its lines) per fence."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = re.match(r"^(\s*)(`{3,}|~{3,})(.*)$", lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match.groups()
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$",
                                              lines[j]):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        blocks.append((info.strip().split(" ")[0].lower() if info.strip() else "", i + 2, body))
        i = j + 1
    return blocks


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            if re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
                fence = None
            continue
        out.append((number, line))
    return out


# ---------------------------------------------------------------------------------- commands
def shell_commands(lines: list[str], first: int) -> list[tuple[int, list[str]]]:
    """(line number, words) of every command in a shell block (the module's rules)."""
    out, buffer, start = [], "", None
    for offset, raw in enumerate(lines):
        line = raw[2:] if raw.startswith("$ ") else raw
        if start is None:
            if not line.strip():
                continue
            start = first + offset
        buffer = f"{buffer}\n{line}" if buffer else line
        if buffer.endswith("\\"):
            buffer = buffer[:-1] + " "
            continue
        try:
            words = _split(buffer)
        except ValueError:  # a quote still open: the command goes on
            continue
        command: list[str] = []
        for word in words + [";"]:
            if word in SEPARATORS:
                if command:
                    out.append((start, command))
                command = []
            else:
                command.append(word)
        buffer, start = "", None
    if buffer.strip():
        out.append((start, ["<unterminated quote>", buffer]))
    return out


def _split(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


class CommandError(Exception):
    """A documented command that its entry point rejects; the message says why."""


class _Parsed(Exception):
    """Raised right after argparse parsed the command line of an example."""


@contextlib.contextmanager
def _stop_after_parsing():
    """argparse's outermost ``parse_args`` / ``parse_known_args`` raises ``_Parsed`` once it
    has parsed (a subparser's parse, nested inside it, returns as usual)."""
    cls = argparse.ArgumentParser
    originals = {name: getattr(cls, name) for name in ("parse_args", "parse_known_args")}
    depth = [0]

    def wrapped(original):
        def method(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(result)
            return result
        return method

    for name, original in originals.items():
        setattr(cls, name, wrapped(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)


def _exits_cleanly(call: Callable[[], object], what: str) -> None:
    """Run ``call``; a ``SystemExit`` other than 0 (an argparse error) is a ``CommandError``
    carrying what was printed."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            call()
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            message = said.getvalue().strip().splitlines()
            detail = message[-1] if message else str(exit_.code).splitlines()[0]
            raise CommandError(f"{what} rejects it: {detail}") from None


def check_hilore(argv: list[str]) -> str:
    from ds_hilore.cli import build_parser

    _exits_cleanly(lambda: build_parser().parse_args(argv), "hilore's parser")
    return "hilore"


def check_run(argv: list[str]) -> str:
    from ds_hilore.run import parse

    holder = {}
    _exits_cleanly(lambda: holder.update(command=parse(argv)), "python -m ds_hilore.run")
    command = holder.get("command")
    if command is None:  # --help
        return "ds_hilore.run"
    if command.module:
        inner = check_module(command.target, command.argv)
    else:
        inner = check_script(command.target, command.argv)
    return f"ds_hilore.run -> {inner}"


def check_module(name: str, argv: list[str]) -> str:
    if name in ("ds_hilore.cli", "ds_hilore.cli.__main__"):
        return check_hilore(argv)
    if name == "ds_hilore.run":
        return check_run(argv)
    if name.split(".")[0] == "examples":
        return check_example(name, argv)
    return "skipped"


def check_script(path: str, argv: list[str]) -> str:
    script = (ROOT / path).resolve()
    if not path.endswith(".py") or not script.is_file() or ROOT not in script.parents:
        return "skipped"  # a script of another project, e.g. train.py
    return check_example(".".join(script.relative_to(ROOT).with_suffix("").parts), argv)


def check_example(name: str, argv: list[str]) -> str:
    path = list(sys.path)
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 -- reported as the command's failure
        raise CommandError(f"cannot import {name}: {type(error).__name__}: {error}") from None
    finally:
        sys.path[:] = path
    if callable(getattr(module, "build_parser", None)):
        _exits_cleanly(lambda: module.build_parser().parse_args(argv), f"{name}'s parser")
        return name
    if not callable(getattr(module, "parse_args", None)):
        raise CommandError(f"{name} has neither build_parser() nor parse_args() to check it with")
    saved = sys.argv

    def run():
        sys.argv = [name, *argv]
        try:
            with _stop_after_parsing():
                module.parse_args()
        except _Parsed:
            return
        finally:
            sys.argv = saved
        raise CommandError(f"{name}.parse_args() returned without parsing a command line")

    _exits_cleanly(run, f"{name}'s parser")
    return name


def check_command(words: list[str]) -> str:
    """What the command's entry point made of it (``"skipped"``: not an entry point checked);
    ``CommandError`` when it rejects it."""
    words = list(words)
    while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])
                     or words[0] in ("env", "time", "nohup")):
        words.pop(0)
    if not words:
        return "skipped"
    head, rest = os.path.basename(words[0]), words[1:]
    if head == "<unterminated quote>":
        raise CommandError("a quote is never closed")
    if head == "hilore":
        return check_hilore(rest)
    if head == "deepspeed":
        return _deepspeed(rest)
    if head in ("mpirun", "mpiexec"):
        while rest and not (_interpreter(rest[0]) or rest[0].endswith(".py")
                            or os.path.basename(rest[0]) == "hilore"):
            rest.pop(0)
        return check_command(rest) if rest else "skipped"
    if head in ("accelerate", "torchrun"):
        if head == "accelerate":
            if not rest or rest[0] != "launch":
                return "skipped"
            rest = rest[1:]
        while rest and rest[0] != "-m" and not rest[0].endswith(".py"):
            rest.pop(0)
        if not rest:
            return "skipped"
        return check_module(rest[1], rest[2:]) if rest[0] == "-m" and len(rest) > 1 \
            else check_script(rest[0], rest[1:])
    if _interpreter(words[0]):
        return _python(rest)
    return "skipped"


def _interpreter(word: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)?)?", os.path.basename(word)) is not None


def _python(args: list[str]) -> str:
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        option = args.pop(0)
        if option in ("-X", "-W") and args:
            args.pop(0)
    if not args or args[0] == "-c":
        return "skipped"
    if args[0] == "-m":
        return check_module(args[1], args[2:]) if len(args) > 1 else "skipped"
    return check_script(args[0], args[1:])


def _deepspeed(args: list[str]) -> str:
    from deepspeed.launcher.runner import parse_args

    holder = {}
    _exits_cleanly(lambda: holder.update(ns=parse_args(args)), "the deepspeed launcher")
    ns = holder.get("ns")
    if ns is None:
        return "deepspeed --help"
    if ns.module:
        return check_module(ns.user_script, list(ns.user_args))
    return check_script(ns.user_script, list(ns.user_args))


@pytest.mark.parametrize("document", _existing_documents())
def test_commands_parse(document):
    failures = []
    text = document.read_text(encoding="utf-8")
    for info, first, lines in fenced_blocks(text):
        if info not in SHELL_INFO:
            continue
        for line, words in shell_commands(lines, first):
            try:
                check_command(words)
            except CommandError as error:
                failures.append(f"{_rel(document)}:{line}: `{shlex.join(words)[:120]}`: {error}")
    assert not failures, "documented commands the code rejects:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------- links
def _ignored_folders() -> list[str]:
    """Folders .gitignore ignores (its entries ending in ``/``), relative to the root."""
    ignore = ROOT / ".gitignore"
    if not ignore.is_file():
        return []
    return [line.strip().strip("/") + "/" for line in ignore.read_text().splitlines()
            if line.strip().endswith("/") and not line.startswith("#")]


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE = re.compile(r"(`+)(.+?)\1")
_PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)+/?")


def _is_path(span: str) -> bool:
    if not _PATH.fullmatch(span):
        return False
    last = span.rstrip("/").rsplit("/", 1)[-1]
    return span.endswith("/") or ("." in last and last.rsplit(".", 1)[-1] in PATH_EXTENSIONS)


@pytest.mark.parametrize("document", _existing_documents())
def test_links_resolve(document):
    failures, ignored = [], _ignored_folders()
    for number, line in prose_lines(document.read_text(encoding="utf-8")):
        plain = _CODE.sub(" ", line)
        for target in _LINK.findall(plain):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0].split("?", 1)[0]
            if path and not (document.parent / path).exists():
                failures.append(f"{_rel(document)}:{number}: link to {target!r}: no such file")
        for _, span in _CODE.findall(line):
            span = span.strip()
            relative = span[2:] if span.startswith("./") else span
            if not _is_path(span) or any(relative.startswith(f) for f in ignored):
                continue
            if not ((ROOT / span).exists() or (document.parent / span).exists()):
                failures.append(f"{_rel(document)}:{number}: `{span}`: no such file in the "
                                "repository")
    assert not failures, "references to files that do not exist:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------- config
def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def config_table(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, cells) of each row of the table headed key | type | default | meaning."""
    rows, inside = [], False
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        if not line.strip().startswith("|"):
            if inside:
                break
            continue
        cells = _cells(line)
        if not inside:
            inside = [c.lower() for c in cells] == ["key", "type", "default", "meaning"]
            continue
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue
        rows.append((number, cells))
    return rows


def test_config_table_is_hilore_config():
    from ds_hilore.config import HiLoReConfig
    from typing import Literal, Union, get_args, get_origin

    document = ROOT / "ds_configs" / "README.md"
    rows = config_table(document)
    where = _rel(document)
    assert rows, f"{where}: no table headed `key | type | default | meaning`"
    fields = HiLoReConfig.model_fields
    failures, seen = [], collections.Counter()
    for number, cells in rows:
        if len(cells) != 4:
            failures.append(f"{where}:{number}: {len(cells)} cells, not 4")
            continue
        key = cells[0].strip("`")
        seen[key] += 1
        if key not in fields:
            failures.append(f"{where}:{number}: `{key}` is not a field of HiLoReConfig")
            continue
        if not cells[1]:
            failures.append(f"{where}:{number}: `{key}` has no type")
        default = re.fullmatch(r"`([^`]*)`", cells[2])
        try:
            value = json.loads(default.group(1)) if default else ValueError
        except ValueError:
            value = ValueError
        expected = fields[key].default
        if value is ValueError or value != expected or \
                isinstance(value, bool) != isinstance(expected, bool):
            failures.append(f"{where}:{number}: `{key}`'s default is {cells[2]!r} here, "
                            f"{json.dumps(expected)} in HiLoReConfig")
        annotation = fields[key].annotation
        options = get_args(annotation) if get_origin(annotation) is Literal else ()
        if get_origin(annotation) is Union:
            options = tuple(x for arg in get_args(annotation) if get_origin(arg) is Literal
                            for x in get_args(arg))
        row = " ".join(cells[1:])
        missing = [json.dumps(x) for x in options if json.dumps(x) not in row]
        if missing:
            failures.append(f"{where}:{number}: `{key}` does not name the values {missing}")
    failures += [f"{where}: `{key}` is listed {n} times" for key, n in seen.items() if n > 1]
    failures += [f"{where}: the field `{key}` of HiLoReConfig is missing from the table"
                 for key in fields if key not in seen]
    assert not failures, "the configuration table against HiLoReConfig:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------- NOTEs
_NOTE = re.compile(r"NOTE\s+\[\s+(.+?)\s+\]", re.S)
_NOTE_LINE = re.compile(r'^\s*(?:#|"""|r""")?\s*NOTE \[ (.+?) \]\s*$')
_NOTE_INLINE = re.compile(r"^\s*#\s*NOTE \[ (.+?) \]:")


def note_definitions(*folders: str) -> dict[str, set[str]]:
    """NOTE name -> the files (relative to the root) that define it (the module's rule)."""
    lines, inline = collections.defaultdict(set), collections.defaultdict(set)
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line in path.read_text(encoding="utf-8").splitlines():
                for pattern, found in ((_NOTE_LINE, lines), (_NOTE_INLINE, inline)):
                    match = pattern.match(line)
                    if match:
                        found[match.group(1)].add(_rel(path))
                        break
    out = dict(lines)
    for name, files in inline.items():
        out.setdefault(name, files)
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("document", _existing_documents())
def test_notes_exist(document):
    defined = note_definitions("ds_hilore", "tests")
    text = document.read_text(encoding="utf-8")
    failures = []
    for match in _NOTE.finditer(text):
        name = _one_line(match.group(1))
        if name not in defined:
            number = text.count("\n", 0, match.start()) + 1
            failures.append(f"{_rel(document)}:{number}: NOTE [ {name} ] is defined nowhere "
                            "under ds_hilore/ or tests/")
    assert not failures, "NOTEs the code does not have:\n" + "\n".join(failures)


def test_note_index_is_complete():
    document = ROOT / "ds_hilore" / "README.md"
    where = _rel(document)
    text = document.read_text(encoding="utf-8")
    assert NOTE_INDEX_HEADING in text, f"{where}: no section {NOTE_INDEX_HEADING!r}"
    start = text.index(NOTE_INDEX_HEADING)
    first = text.count("\n", 0, start) + 1
    listed, failures = {}, []
    for offset, line in enumerate(text[start:].splitlines()[1:], 1):
        if line.startswith("#"):
            break
        if not line.strip().startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) != 2 or cells[0].lower() == "note" or re.fullmatch(r":?-+:?", cells[0]):
            continue
        name, file = cells[0], cells[1].strip("`")
        if name in listed:
            failures.append(f"{where}:{first + offset}: NOTE [ {name} ] is listed twice")
        listed[name] = (first + offset, file)
    defined = note_definitions("ds_hilore")
    for name, files in sorted(defined.items()):
        if name not in listed:
            failures.append(f"{where}: NOTE [ {name} ] ({', '.join(sorted(files))}) is missing "
                            "from the index")
    for name, (number, file) in listed.items():
        if name not in defined:
            failures.append(f"{where}:{number}: NOTE [ {name} ] is defined nowhere under "
                            "ds_hilore/")
        elif f"ds_hilore/{file}" not in defined[name]:
            failures.append(f"{where}:{number}: NOTE [ {name} ] is in "
                            f"{', '.join(sorted(defined[name]))}, not ds_hilore/{file}")
    assert not failures, "the index of NOTEs against the code:\n" + "\n".join(failures)
