"""Every SQL, Python and shell snippet of README.md and docs/ runs against real servers,
or says, right above its fence, why it does not: so an example cannot rot.

The rules of the runner:

- **What is collected.** Fenced blocks (``` or ~~~, parsed by markdown-it as MyST does)
  of README.md and docs/**/*.md, but docs/_build, docs/_ext and docs/reference (made
  from the code) and CHANGELOG.md. The language is the info string's first word, or the
  argument of a `{code-block}` / `{code}` / `{sourcecode}` directive; the content of any
  other `{directive}` fence is searched for blocks in turn. `sql` is SQL; `python`/`py`
  is Python; `sh`, `bash`, `shell` and `console` (its `$ ` lines) are shell. Any other
  language (yaml, json, text, ini, promela, ...) is not code to run. Every fence must
  name a language and be closed: a fence without one, or one that runs to the end of the
  page (a closing fence with an info string does not close), fails naming file:line.
- **Not run.** A code block that cannot run here has, on the line right before its
  fence, `% not-run: <reason>` in a docs page (a MyST comment) or
  `<!-- not-run: <reason> -->` in README.md. The reason must not be empty. A marker in
  the wrong form, one above a block that is not code, or one with no block under it
  fails naming file:line. So does a runnable shell block with a command that would
  change this machine or needs what the suite does not have (`pip`, `apt-get`, `sudo`,
  `docker`, `podman`, `kubectl`, `helm`, `./dev`): it is never run, it must be marked.
  These checks need no server (`test_snippets_are_marked`, `./dev test --unit`).
- **Run, per page, in order** (`test_page_snippets_run`, one test per page with code to
  run, its id the page's path), on one fresh migrated database of the page's own, so a
  block may use what an earlier block of its page made; the first failing block fails
  the test naming file:line and its output.
  - SQL: one `execute` of the block's whole text on a new autocommit connection as the
    superuser (so a `BEGIN; ... COMMIT;` in the text is the transaction), 30 s
    statement timeout.
  - Python: the venv's python runs the block as a file, cwd a temporary directory, 60 s.
  - Shell: `bash -euo pipefail` runs the block, cwd a temporary directory, the venv's
    bin first on PATH (so `relay ...` works), 60 s. Variables a block exports reach the
    page's later shell and Python blocks.
  - Environment: `RELAY_DATABASE_URL` (the page's database, superuser: `relay migrate`
    needs the schema owner), `RELAY_KAFKA_BOOTSTRAP_SERVERS` (the session's Tansu
    broker), `RELAY_METRICS_PORT` and `RELAY_CONSOLE_PORT` (free ports), `PYTHONPATH`
    (the checkout); no other `RELAY_*` of the caller's.
- **Daemons.** A shell line that starts `relay run` or `relay console` (after any
  `VAR=value` prefixes) must be the block's last command. The block runs as above up to
  that line (which must succeed within the timeout); the daemon must then still be
  running 2 s later, and it is left running in the background while the page's later
  blocks run, as a reader following the page in a second terminal would. At the end of
  the page it must still be running; it is then stopped (SIGTERM, SIGKILL after 10 s),
  which counts as success. A daemon that exits by itself, with any status, fails the page.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token
from mdit_py_plugins.colon_fence import colon_fence_plugin

from tests.harness import free_port

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

LANGUAGES = {
    "sql": "sql",
    "python": "python",
    "py": "python",
    "sh": "sh",
    "bash": "sh",
    "shell": "sh",
    "console": "sh",
}
CODE_DIRECTIVES = {"{code-block}", "{code}", "{sourcecode}"}
MARKER_DOCS = re.compile(r"^%\s*not-run:(.*)$")
MARKER_README = re.compile(r"^<!--\s*not-run:(.*?)-->$")
LOOKS_LIKE_MARKER = re.compile(r"not[- _]?run", re.IGNORECASE)
DAEMON = re.compile(
    r"""^\s*(?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|"[^"]*"|\S*)\s+)*relay\s+(?:run|console)\b"""
)

# Commands a runnable block may not have: they would change this machine (an install
# into the venv the suite runs in), or need a container engine, a cluster or the whole
# harness. Such a block is marked not-run.
FORBIDDEN = re.compile(
    r"^\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*"
    r"(?:sudo|pip3?|python3?\s+-m\s+pip|uv\s+pip|apt|apt-get|dnf|yum|docker|podman|kubectl|helm"
    r"|\./dev)\b"
)

SQL_STATEMENT_TIMEOUT_MS = 30_000
BLOCK_TIMEOUT = 60.0
DAEMON_GRACE = 2.0
DAEMON_STOP_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    word: str  # the language as the page names it
    language: str | None  # "sql", "python", "sh"; None: not code to run
    text: str
    not_run: str | None  # the marker's reason; "" for a marker without one

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


@dataclass(slots=True)
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def runnable(self) -> list[Block]:
        return [b for b in self.blocks if b.language is not None and b.not_run is None]


def pages() -> list[Path]:
    docs = REPO / "docs"
    skipped = {docs / "_build", docs / "_ext", docs / "reference"}
    found = [REPO / "README.md"]
    for path in sorted(docs.rglob("*.md")):
        if not any(path.is_relative_to(s) for s in skipped):
            found.append(path)
    return found


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark").use(colon_fence_plugin)


def _language(info: str) -> tuple[str, str | None, bool]:
    """(the language word, its runner or None, whether the fence is another directive)."""
    words = info.split()
    if not words:
        return "", None, False
    if words[0] in CODE_DIRECTIVES:
        word = words[1] if len(words) > 1 else ""
        return word, LANGUAGES.get(word.lower()), False
    if words[0].startswith("{"):
        return words[0], None, True
    word = words[0]
    return word, LANGUAGES.get(word.lower()), False


def _directive_body(content: str) -> tuple[str, int]:
    """A directive's content without its `:option:` lines (and a blank line after them),
    with how many lines were dropped."""
    lines = content.split("\n")
    dropped = 0
    while dropped < len(lines) and re.match(r"^:\w[\w-]*:", lines[dropped]):
        dropped += 1
    if dropped and dropped < len(lines) and not lines[dropped].strip():
        dropped += 1
    return "\n".join(lines[dropped:]), dropped


def _closed(token: Token, lines: list[str]) -> bool:
    assert token.map is not None
    last = lines[token.map[1] - 1].strip() if token.map[1] - 1 < len(lines) else ""
    opener = token.markup
    if token.map[1] - token.map[0] < 2:
        return False
    return bool(re.fullmatch(re.escape(opener[0]) + f"{{{len(opener)},}}", last))


def _marker(path: Path, lines: list[str], index: int) -> tuple[str | None, str | None]:
    """(the not-run reason above line `index` (0-based) or None, a problem or None)."""
    if index == 0:
        return None, None
    above = lines[index - 1].strip()
    readme = path == REPO / "README.md"
    match = (MARKER_README if readme else MARKER_DOCS).match(above)
    if match:
        return match[1].strip(), None
    if LOOKS_LIKE_MARKER.search(above) and (above.startswith(("%", "<!--"))):
        form = "<!-- not-run: REASON -->" if readme else "% not-run: REASON"
        return None, f"a not-run marker not in the form `{form}`: {above!r}"
    return None, None


def _shell_lines(block: Block) -> list[str]:
    lines = block.text.rstrip("\n").split("\n")
    if block.word.lower() == "console":  # only the commands after the prompt
        return [line[2:] for line in lines if line.startswith("$ ")]
    return lines


def _commands(lines: list[str]) -> list[tuple[int, str]]:
    """The commands of a shell block: (index of its first line, its logical line), a line
    ending in a backslash joined to the next; blank lines and comments left out."""
    logical: list[tuple[int, str]] = []
    start: int | None = None
    joined = ""
    for index, line in enumerate(lines):
        if start is None:
            start, joined = index, ""
        continued = line.rstrip().endswith("\\")
        joined += line.rstrip().removesuffix("\\") + " " if continued else line
        if not continued:
            logical.append((start, joined))
            start = None
    return [(i, text) for i, text in logical if text.strip() and not text.lstrip().startswith("#")]


def _daemon_line(lines: list[str]) -> int | None:
    """Index of the line where the block's daemon command starts, if it has one."""
    commands = _commands(lines)
    daemons = [n for n, (_, text) in enumerate(commands) if DAEMON.match(text)]
    if not daemons:
        return None
    if daemons != [len(commands) - 1]:
        raise SnippetFailed("a daemon's command (relay run / console) must be the block's last")
    return commands[daemons[0]][0]


def _scan(page: Page, text: str, offset: int, path: Path, lines: list[str]) -> None:
    """Blocks of `text`, whose first line is line `offset` (0-based) of the page."""
    local = text.split("\n")
    for token in _parser().parse(text):
        if token.type not in {"fence", "colon_fence"} or token.map is None:
            continue
        start = offset + token.map[0]
        where = f"{path.relative_to(REPO)}:{start + 1}"
        if not _closed(token, local):
            page.problems.append(f"{where}: the fence is never closed (it runs to the end)")
        word, language, directive = _language(token.info)
        if token.type == "colon_fence" or directive:
            body, dropped = _directive_body(token.content)
            _scan(page, body, start + 1 + dropped, path, lines)
            continue
        if not word:
            page.problems.append(f"{where}: a fence without a language")
        reason, problem = _marker(path, lines, start)
        if problem:
            page.problems.append(f"{where}: {problem}")
        if reason is not None and language is None:
            page.problems.append(f"{where}: a not-run marker above a block of {word!r}")
        if reason == "":
            page.problems.append(f"{where}: a not-run marker without a reason")
        block = Block(path, start + 1, word, language, token.content, reason)
        if language == "sh" and reason is None:
            for command in _commands(_shell_lines(block)):
                if FORBIDDEN.match(command[1]):
                    page.problems.append(
                        f"{where}: `{command[1].strip()}` would change this machine or needs a "
                        "container engine, a cluster or the harness: mark the block not-run"
                    )
        page.blocks.append(block)


def parse(path: Path) -> Page:
    text = path.read_text()
    lines = text.split("\n")
    page = Page(path)
    _scan(page, text, 0, path, lines)
    # A marker with no fence under it.
    fences = {b.line - 1 for b in page.blocks}
    marker = MARKER_README if path == REPO / "README.md" else MARKER_DOCS
    for index, line in enumerate(lines):
        if marker.match(line.strip()) and index + 1 not in fences:
            page.problems.append(
                f"{path.relative_to(REPO)}:{index + 1}: a not-run marker with no fence "
                "on the next line"
            )
    return page


PAGES = [parse(path) for path in pages()]


def _id(page: Page) -> str:
    return str(page.path.relative_to(REPO))


@pytest.mark.unit
@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_snippets_are_marked(page: Page) -> None:
    """Fences are well formed and every not-run marker has its form and a reason."""
    if page.problems:
        pytest.fail("\n".join(page.problems), pytrace=False)


@pytest.mark.unit
def test_some_snippets_are_found() -> None:
    """The collection itself works: the pages have code, most of it run."""
    blocks = [b for p in PAGES for b in p.blocks if b.language is not None]
    assert len(blocks) > 20
    assert sum(b.not_run is None for b in blocks) > len(blocks) / 3


# --- running ---


class SnippetFailed(Exception):
    pass


def _tail(text: str, limit: int = 4000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


@dataclass
class Daemon:
    block: Block
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return _tail(self.log.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=DAEMON_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Runner:
    def __init__(self, workdir: Path, env: dict[str, str], dsn: str) -> None:
        self.work = workdir / "work"
        self.scripts = workdir / "scripts"
        self.work.mkdir()
        self.scripts.mkdir()
        self.env = env
        self.dsn = dsn
        self.daemons: list[Daemon] = []

    def run(self, block: Block) -> None:
        if block.language == "sql":
            self._sql(block)
        elif block.language == "python":
            self._python(block)
        else:
            self._shell(block)

    def _sql(self, block: Block) -> None:
        options = f"-c statement_timeout={SQL_STATEMENT_TIMEOUT_MS}"
        try:
            with psycopg.connect(self.dsn, autocommit=True, options=options) as conn:
                conn.execute(block.text.encode())
        except psycopg.Error as exc:
            raise SnippetFailed(f"{type(exc).__name__}: {exc}") from exc

    def _python(self, block: Block) -> None:
        script = self.scripts / f"block-{block.line}.py"
        script.write_text(block.text)
        self._run_to_end([sys.executable, str(script)], block)

    def _run_to_end(self, command: list[str], block: Block) -> None:
        """Run a block's process to its end; its output is kept beside its script."""
        proc = subprocess.Popen(
            command,
            cwd=self.work,
            env=self._block_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            timed_out = True
        (self.scripts / f"block-{block.line}.out").write_bytes(out)
        output = _tail(out.decode(errors="replace"))
        if timed_out:
            raise SnippetFailed(f"still running after {BLOCK_TIMEOUT:.0f} s\n{output}")
        if proc.returncode != 0:
            raise SnippetFailed(f"exit status {proc.returncode}\n{output}")

    def _block_env(self) -> dict[str, str]:
        env = dict(self.env)
        env["RELAY_METRICS_PORT"] = str(free_port())
        env["RELAY_CONSOLE_PORT"] = str(free_port())
        return env

    def _shell(self, block: Block) -> None:
        lines = _shell_lines(block)
        daemon_at = _daemon_line(lines)
        env_out = self.scripts / f"block-{block.line}.env"
        started = self.scripts / f"block-{block.line}.started"
        script_lines = [
            f"trap 'env -0 > {shlex.quote(str(env_out))}' EXIT",
            *lines,
        ]
        if daemon_at is not None:
            # Save the environment and say so just before the daemon's line.
            script_lines.insert(
                daemon_at + 1,
                f"env -0 > {shlex.quote(str(env_out))}; : > {shlex.quote(str(started))}",
            )
        script = self.scripts / f"block-{block.line}.sh"
        script.write_text("\n".join(script_lines) + "\n")
        command = ["bash", "-euo", "pipefail", str(script)]
        if daemon_at is None:
            self._run_to_end(command, block)
            self._take_env(env_out)
            return
        log = self.scripts / f"block-{block.line}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                command,
                cwd=self.work,
                env=self._block_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        daemon = Daemon(block, proc, log)
        self.daemons.append(daemon)
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while not started.exists():
            if proc.poll() is not None:
                raise SnippetFailed(
                    f"exit status {proc.returncode} before the daemon's line\n{daemon.output()}"
                )
            if time.monotonic() > deadline:
                raise SnippetFailed(
                    f"the daemon's line not reached after {BLOCK_TIMEOUT:.0f} s\n{daemon.output()}"
                )
            time.sleep(0.05)
        self._take_env(env_out)
        try:
            proc.wait(timeout=DAEMON_GRACE)
        except subprocess.TimeoutExpired:
            return  # still running: started
        raise SnippetFailed(
            f"the daemon exited by itself (status {proc.returncode})\n{daemon.output()}"
        )

    def _take_env(self, env_out: Path) -> None:
        if not env_out.exists():
            return
        for entry in env_out.read_bytes().decode(errors="replace").split("\0"):
            name, sep, value = entry.partition("=")
            if sep and name not in {"_", "SHLVL", "PWD", "OLDPWD"}:
                self.env[name] = value

    def finish(self) -> list[str]:
        """Stop the daemons; the failures of those that did not run till now."""
        failures = []
        for daemon in self.daemons:
            status = daemon.proc.poll()
            if status is not None:
                failures.append(
                    f"{daemon.block.where}: the daemon exited by itself (status {status})\n"
                    f"{daemon.output()}"
                )
            daemon.stop()
        return failures


def _page_env(dsn: str, bootstrap: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["RELAY_DATABASE_URL"] = dsn
    if bootstrap is not None:
        env["RELAY_KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    return env


RUNNABLE = [page for page in PAGES if page.runnable]


@pytest.mark.parametrize("page", RUNNABLE, ids=_id)
def test_page_snippets_run(
    page: Page, database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if page.problems:
        pytest.fail("\n".join(page.problems), pytrace=False)
    bootstrap = None
    if any(b.language != "sql" for b in page.runnable):
        bootstrap = request.getfixturevalue("kafka").bootstrap_servers
    runner = Runner(tmp_path, _page_env(database, bootstrap), database)
    failure = None
    try:
        for block in page.runnable:
            try:
                runner.run(block)
            except SnippetFailed as exc:
                failure = f"{block.where} ({block.language}) failed: {exc}"
                break
    finally:
        stopped = runner.finish()
    if failure:
        pytest.fail(failure, pytrace=False)
    if stopped:
        pytest.fail("\n".join(stopped), pytrace=False)
