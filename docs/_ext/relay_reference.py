"""The docs site's generated references: settings, command line, metrics, runbooks.

Each reference page (docs/reference/*.md, and docs/operations/runbooks.md) holds a
marker line, `<!-- relay-reference: settings -->`; when Sphinx reads the page this
extension puts the Markdown made from the code in its place. Nothing generated is
committed, so the references cannot drift from the code:

- settings: every field of `relay.settings.Settings` (the common settings, the daemon's,
  each sink's) and of `relay.console.settings.ConsoleSettings`, from the pydantic models;
- command line: every command, subcommand and option of `relay.admin.cli.build_parser()`;
- metrics: every metric the relay's modules register in prometheus_client's registry;
- runbooks: every alert of deploy/monitoring/relay-alerts.yml, in file order (severity,
  `for:`, expression), with its `### <AlertName>` runbook from deploy/README.md's
  *Runbooks* (the source of truth; its links are made to work from the docs page). An
  alert without a runbook there fails the build.

The functions `settings_markdown`, `cli_markdown` and `metrics_markdown` are what
tests/test_docs.py checks against its own look at the code. A setting without a
description, an option without help or a metric without help text is printed with the
`UNDOCUMENTED` mark, which the test looks for.

The extension also lets the index's `:glob:` toctree entries match nothing (a section
whose pages are not written yet): Sphinx would warn, and the build treats warnings as
errors.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo
    from sphinx.application import Sphinx
    from sphinx.environment import BuildEnvironment

UNDOCUMENTED = "**Undocumented**"
MARKER = re.compile(r"^<!--\s*relay-reference:\s*([a-z-]+)\s*-->\s*$", re.MULTILINE)


def _code(value: str) -> str:
    ticks = "``" if "`" in value else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{value}{pad}{ticks}"


_BARE_VARIABLE = re.compile(
    r"(?<![\w`])(RELAY_(?:[A-Z0-9_]*[A-Z0-9]|\*)(?:=[\w.:/-]*\w)?)(?![\w`*])"
)


_FLAG = re.compile(r"(?<![\w`-])(--[a-z][a-z0-9-]*)(?![\w`-])")


def _prose(text: str) -> str:
    """A description as Markdown: variable names and options outside code spans set
    as code (and kept from typography: `--x` would become an en dash)."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(
        part if part.startswith("`") else _FLAG.sub(r"`\1`", _BARE_VARIABLE.sub(r"`\1`", part))
        for part in parts
    )


def _fields(pairs: list[tuple[str, str]]) -> list[str]:
    """One line of facts, `**Type:** integer · **Default:** 5`, the empty ones left out."""
    return [" · ".join(f"**{name}:** {value}" for name, value in pairs if value), ""]


# --- settings ---


@dataclass(frozen=True)
class Setting:
    variable: str  # RELAY_...
    section: str
    type: str
    default: str
    bounds: str
    secret: bool
    file_variable: str | None  # RELAY_..._FILE, where the secret may come from a file
    description: str | None
    nested: str | None = None  # RELAY_..__<KEY>, for maps


@dataclass
class Section:
    title: str
    intro: str
    settings: list[Setting] = field(default_factory=list)


def _type_text(annotation: Any) -> str:
    """How the value is written (an optional one's default says "unset")."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return " or ".join(_type_text(a) for a in members)
    if origin is Literal:
        return "one of " + ", ".join(_code(str(v)) for v in get_args(annotation))
    if origin is dict or annotation is dict:
        return "JSON object"
    from pydantic import SecretStr

    names: dict[Any, str] = {
        str: "string",
        SecretStr: "string",
        int: "integer",
        float: "number",
        bool: "boolean (`true`/`false`)",
    }
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default_text(info: FieldInfo) -> str:
    from pydantic_core import PydanticUndefined

    if info.default_factory is not None:
        factory: Any = info.default_factory
        if factory in (dict, list):
            return _code(repr(factory()))
        return f"computed ({_code(factory.__name__ + '()')})"
    value = info.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return _code(str(value).lower())
    if value == "":
        return "empty"
    return _code(str(value))


def _bounds_text(info: FieldInfo) -> str:
    marks = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    parts: list[str] = []
    for meta in info.metadata:
        for attribute, mark in marks.items():
            value = getattr(meta, attribute, None)
            if value is not None:
                parts.append(f"{mark} {value:g}" if isinstance(value, float) else f"{mark} {value}")
        if getattr(meta, "min_length", None) is not None:
            parts.append(f"length ≥ {meta.min_length}")
        if getattr(meta, "max_length", None) is not None:
            parts.append(f"length ≤ {meta.max_length}")
        if getattr(meta, "pattern", None) is not None:
            parts.append(f"pattern {_code(meta.pattern)}")
    return ", ".join(parts)


def _is_secret_type(annotation: Any) -> bool:
    from pydantic import SecretStr

    return annotation is SecretStr or SecretStr in get_args(annotation)


def _settings_of(
    model: type[BaseModel],
    names: list[str],
    *,
    prefix: str,
    section: str,
    file_secrets: tuple[str, ...],
    nested_maps: bool,
) -> list[Setting]:
    found = []
    for name in names:
        info = model.model_fields[name]
        variable = prefix + name.upper()
        kind = _type_text(info.annotation)
        is_map = kind == "JSON object"
        found.append(
            Setting(
                variable=variable,
                section=section,
                type=kind,
                default=_default_text(info),
                bounds=_bounds_text(info),
                secret=name in file_secrets or _is_secret_type(info.annotation),
                file_variable=f"{variable}_FILE" if name in file_secrets else None,
                description=info.description,
                nested=f"{variable}__<KEY>" if is_map and nested_maps else None,
            )
        )
    return found


_SINK_TITLES = {"kafka": "Kafka", "http": "HTTP", "nats": "NATS JetStream", "rabbitmq": "RabbitMQ"}


def setting_sections() -> list[Section]:
    """Every setting of the relay and its console, by section."""
    from relay.console import settings as console
    from relay.settings import ENV_PREFIX, SECRET_FIELDS, CommonSettings, Settings
    from relay.sinks import sink_specs

    specs = sink_specs()
    common = list(CommonSettings.model_fields)
    of_sinks = {name for spec in specs.values() for name in spec.settings.model_fields}
    daemon = [n for n in Settings.model_fields if n not in common and n not in of_sinks]

    def relay_settings(names: list[str], section: str) -> list[Setting]:
        return _settings_of(
            Settings,
            names,
            prefix=ENV_PREFIX,
            section=section,
            file_secrets=SECRET_FIELDS,
            nested_maps=True,
        )

    sections = [
        Section(
            "Common",
            "Read by every command (`relay migrate`, `relay status`, the console's database "
            "connection too): the database, the lease's name, logging.",
            relay_settings(common, "common"),
        ),
        Section(
            "The relay (`relay run`)",
            "The drain, the lease, wake-ups, limits, retries, retention and the metrics "
            "endpoint. `relay check` validates them too.",
            relay_settings(daemon, "relay"),
        ),
    ]
    for name, spec in specs.items():
        title = _SINK_TITLES.get(name, name.capitalize())
        intro = f"Read when `RELAY_SINK={name}`."
        if spec.extra:
            intro += (
                f" Needs the `{spec.extra}` extra: `pip install 'pg-outbox-relay[{spec.extra}]'`."
            )
        sink = Section(
            f"{title} sink", intro, relay_settings(list(spec.settings.model_fields), name)
        )
        sections.append(sink)
    sections.append(
        Section(
            "Console (`relay console`)",
            "The operators' web console reads these besides the common settings "
            "(its database connection).",
            _settings_of(
                console.ConsoleSettings,
                list(console.ConsoleSettings.model_fields),
                prefix=console.PREFIX,
                section="console",
                file_secrets=tuple(console.SECRETS),
                nested_maps=False,
            ),
        )
    )
    return sections


def _kafka_pass_through_secrets() -> list[str]:
    try:
        from relay.sinks.kafka.settings import LIBRDKAFKA_SECRETS
    except ImportError:  # pragma: no cover - a build without the Kafka sink
        return []
    return sorted(LIBRDKAFKA_SECRETS)


def settings_markdown() -> str:
    lines = [
        "Every setting is an environment variable; names are case-insensitive. "
        "A variable starting with `RELAY_` that is no setting stops every command "
        "with the closest name, so a typo is not a silent default.",
        "",
        "- **Secret**: never logged or shown. A secret with a file form may instead be "
        "given as the path of a file that holds it (`RELAY_<NAME>_FILE`: Kubernetes "
        "Secret volumes, Docker secrets); giving both is an error.",
        "- **JSON object**: a map given as JSON; the relay's maps also take one variable "
        "per entry, `RELAY_<NAME>__<KEY>`.",
        "- **Bounds**: a value outside them stops the command at start, naming the variable.",
        "",
    ]
    for section in setting_sections():
        lines += [f"## {section.title}", "", section.intro, ""]
        if section.title.startswith("Kafka"):
            secrets = _kafka_pass_through_secrets()
            if secrets:
                lines += [
                    "The librdkafka pass-through (`RELAY_KAFKA__<PROPERTY>`) keeps these "
                    "properties secret; each may also come from a file, "
                    "`RELAY_KAFKA__<PROPERTY>_FILE` (dots as underscores): "
                    + ", ".join(_code(s) for s in secrets)
                    + ".",
                    "",
                ]
        for s in section.settings:
            lines += [f"### {_code(s.variable)}", ""]
            lines += [_prose(s.description) if s.description else UNDOCUMENTED, ""]
            secrecy = ""
            if s.secret:
                secrecy = "yes"
                if s.file_variable:
                    secrecy += f"; or from a file: {_code(s.file_variable)} (its path)"
            lines += _fields(
                [
                    ("Type", s.type),
                    ("Default", s.default),
                    ("Bounds", s.bounds),
                    ("Secret", secrecy),
                    ("Entries", _code(s.nested) if s.nested else ""),
                ]
            )
    return "\n".join(lines)


# --- command line ---


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]  # ("--timeout",) or ("ID",) for a positional
    value: str
    default: str
    help: str | None
    note: str


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("relay", "dead-letter", "list")
    help: str | None
    usage: str
    options: list[Option]


def _value_text(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    text = _code(str(metavar))
    if action.nargs in ("+", "*"):
        text += " (one or more)" if action.nargs == "+" else " (any number)"
    kind = getattr(action.type, "__name__", None)
    kinds = {
        "int": "integer",
        "float": "number",
        "parse_duration": "duration: `90`, `45s`, `30m`, `12h`, `7d`",
        "_positive_int": "positive integer",
    }
    if kind in kinds:
        text += f", {kinds[kind]}"
    elif kind and kind != "str":
        text += f", {kind.strip('_').replace('_', ' ')}"
    if action.choices:
        text += ", one of " + ", ".join(_code(str(c)) for c in action.choices)
    return text


def _default_of(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""
    return _code(str(action.default))


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...], help_: str | None
) -> Iterator[Command]:
    parser.formatter_class = functools.partial(argparse.HelpFormatter, width=88)
    groups = {id(a): g for g in parser._mutually_exclusive_groups for a in g._group_actions}
    options = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        note = ""
        group = groups.get(id(action))
        if group is not None:
            others = ", ".join(_code(a.option_strings[0]) for a in group._group_actions)
            note = f"(one of {others}" + ("; required)" if group.required else ")")
        names = tuple(action.option_strings) or (str(action.metavar or action.dest),)
        options.append(Option(names, _value_text(action), _default_of(action), action.help, note))
    sub = _subparsers(parser)
    first, *rest = parser.format_usage().rstrip().splitlines()
    usage = "\n".join([first.removeprefix("usage: "), *(line[7:] for line in rest)])
    yield Command(path, help_ or parser.description, usage, options)
    if sub is None:
        return
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    for name, child in sub.choices.items():
        yield from _walk(child, (*path, name), helps.get(name) or child.description)


def commands() -> list[Command]:
    """Every command of `relay`, the program itself first."""
    from relay.admin.cli import build_parser

    parser = build_parser()
    return list(_walk(parser, ("relay",), parser.description))


def cli_markdown() -> str:
    from relay.admin import cli

    lines = [
        "Every command of `relay` (also `python -m relay`); each also takes `-h` "
        "(`--help`). Settings come from the environment ([settings](settings.md)), not "
        f"from options. Exit status: {cli.EXIT_OK} done, {cli.EXIT_FAILURE} failed (the "
        f"database or the sink), {cli.EXIT_CONFIG} a configuration error or a bad option.",
        "",
    ]
    for command in commands():
        depth = min(len(command.path) + 1, 4)
        lines += ["#" * depth + " " + _code(" ".join(command.path)), ""]
        lines += [_prose(command.help) if command.help else UNDOCUMENTED, ""]
        lines += ["```text", command.usage, "```", ""]
        for option in command.options:
            facts = [f for f in (option.value, option.default and "default " + option.default) if f]
            if option.default == "required":
                facts[-1] = "required"
            term = ", ".join(_code(n) for n in option.names)
            if facts:
                term += " (" + "; ".join(facts) + ")"
            help_ = _prose(option.help) if option.help else UNDOCUMENTED
            if option.note:
                help_ += " " + option.note
            lines += [term, f": {help_}", ""]
    return "\n".join(lines)


# --- metrics ---


@dataclass(frozen=True)
class MetricEntry:
    name: str  # as scraped: counters with _total, info with _info
    type: str
    labels: tuple[str, ...] | None  # None: not known to this generator
    help: str
    group: str


def metric_modules() -> list[str]:
    """The relay's modules that use prometheus_client: importing them registers
    their metrics."""
    import relay

    found = []
    for module in pkgutil.walk_packages(relay.__path__, "relay."):
        if module.name.endswith("__main__") or module.ispkg:
            continue
        spec = importlib.util.find_spec(module.name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        if "prometheus_client" in Path(spec.origin).read_text(encoding="utf-8"):
            found.append(module.name)
    return found


def _example_collector(collector: Any) -> Any:
    """A filled copy of a collector whose series exist only once the relay runs,
    so their labels show. Others as they are."""
    from relay.lease.metrics import LeaseCollector
    from relay.lease.protocol import Shard
    from relay.observe.lag import ShardLag, ShardLagCollector

    if isinstance(collector, ShardLagCollector):
        lag = ShardLagCollector()
        lag.set("default", [ShardLag(0, 2, 0, 0.0, 1)])
        return lag
    if isinstance(collector, LeaseCollector):
        leases = LeaseCollector()
        leases.declare(Shard("default", 0, 2), lambda: True, lambda: 0.0)
        return leases
    return collector


def _scraped_name(family: Metric) -> str:
    suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
    return family.name + suffix


def _group(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "sinks":
        sink = parts[2].split("_")[0]
        return f"{_SINK_TITLES.get(sink, sink.capitalize())} sink"
    return "The relay"


def _entries_of(collector: Any, group: str) -> Iterator[MetricEntry]:
    from prometheus_client.metrics import MetricWrapperBase

    if isinstance(collector, MetricWrapperBase):
        labels: tuple[str, ...] | None = tuple(collector._labelnames)
        for family in collector.describe():
            yield MetricEntry(
                _scraped_name(family), family.type, labels, family.documentation, group
            )
        return
    fixed = getattr(collector, "_label", None)  # relay.observe.metrics.BatchHistogram
    for family in _example_collector(collector).collect():
        if isinstance(fixed, str):
            labels = (fixed,)
        elif family.samples:
            labels = tuple(dict.fromkeys(k for s in family.samples for k in s.labels))
            labels = tuple(k for k in labels if k not in ("le", "quantile"))
        else:
            labels = None
        yield MetricEntry(_scraped_name(family), family.type, labels, family.documentation, group)


def _is_collector(value: object) -> bool:
    """A metric object, or a collector of the relay's own (prometheus_client's
    Collector is a protocol, not a class to check against); not a registry."""
    from prometheus_client.registry import CollectorRegistry

    return (
        not isinstance(value, type | CollectorRegistry)
        and not inspect.ismodule(value)
        and callable(getattr(value, "collect", None))
    )


def metric_entries() -> list[MetricEntry]:
    """Every metric in prometheus_client's registry once the relay's metric modules
    are imported: the relay's own, by module, then the client library's."""
    from prometheus_client import REGISTRY

    entries: dict[str, MetricEntry] = {}
    for module_name in metric_modules():
        module = importlib.import_module(module_name)
        for _, value in inspect.getmembers(module):
            if _is_collector(value):
                for entry in _entries_of(value, _group(module_name)):
                    entries.setdefault(entry.name, entry)
    for family in REGISTRY.collect():  # whatever no module keeps in a global
        name = _scraped_name(family)
        if name in entries:
            continue
        group = "The relay" if name.startswith("relay_") else "The Prometheus client library"
        labels = tuple(dict.fromkeys(k for s in family.samples for k in s.labels))
        entries[name] = MetricEntry(name, family.type, labels, family.documentation, group)
    order = ["The relay", *sorted({e.group for e in entries.values()} - {"The relay"})]
    order.sort(key=lambda g: g == "The Prometheus client library")
    return sorted(entries.values(), key=lambda e: (order.index(e.group), e.name))


def metrics_markdown() -> str:
    lines = [
        "What each replica serves at `/metrics` (`RELAY_METRICS_HOST`:`RELAY_METRICS_PORT`, "
        "unless `RELAY_METRICS_PORT=0`). The names are as scraped: counters end in "
        "`_total`; a histogram is its `_bucket`, `_sum` and `_count` series. The `shard` "
        "label appears only with `RELAY_SHARDS` above 1; a sink's metrics only with that "
        "sink.",
        "",
    ]
    group = None
    for entry in metric_entries():
        if entry.group != group:
            group = entry.group
            lines += [f"## {group}", ""]
        if entry.labels is None:
            labels = UNDOCUMENTED + " (add an example to docs/_ext/relay_reference.py)"
        else:
            labels = ", ".join(_code(label) for label in entry.labels) or "none"
            if entry.type == "info" and not entry.labels:
                labels = "the facts it carries (set at start; the value is 1)"
        help_ = _prose(entry.help) if entry.help.strip() else UNDOCUMENTED
        lines += [f"### {_code(entry.name)}", "", help_, ""]
        lines += _fields([("Type", entry.type), ("Labels", labels)])
    return "\n".join(lines)


# --- runbooks ---

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "monitoring" / "relay-alerts.yml"
DEPLOY_README = REPO / "deploy" / "README.md"
RUNBOOKS_PAGE = REPO / "docs" / "operations" / "runbooks.md"

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
# A code span (left as it is) or an inline link or image.
_LINK = re.compile(
    r"(?P<code>(?P<ticks>`+).+?(?<!`)(?P=ticks)(?!`))"
    r"|(?P<bang>!?)\[(?P<label>[^\]]*)\]\((?P<target>[^()\s]+)\)",
    re.DOTALL,
)


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    for_: str | None  # None: fires as soon as the condition holds
    expr: str


def alerts(path: Path = ALERTS) -> list[Alert]:
    """The alert rules of relay-alerts.yml, in file order."""
    import yaml

    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [
        Alert(
            name=rule["alert"],
            severity=rule.get("labels", {}).get("severity", "none"),
            for_=rule.get("for"),
            expr=str(rule["expr"]).strip(),
        )
        for group in document["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def runbook_sections(path: Path = DEPLOY_README) -> dict[str, str]:
    """Each `### <AlertName>` subsection of the README's `## Runbooks` section -> its
    text up to the next `###` or `##` heading (headings inside code fences are text)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    in_runbooks = False
    fence: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        opening = _FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
        elif opening:
            fence = opening.group(1)
        else:
            heading = _HEADING.match(line)
            if heading and len(heading.group(1)) <= 3:
                level, title = len(heading.group(1)), heading.group(2)
                if level <= 2:
                    in_runbooks = level == 2 and title == "Runbooks"
                    current = None
                elif in_runbooks:
                    current = sections.setdefault(title, [])
                else:
                    current = None
                continue
        if current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip("\n") for name, lines in sections.items()}


def _shown(path: Path) -> str:
    """A path as the repository names it (or as given, outside it)."""
    resolved = path.resolve()
    return resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else str(path)


def _relinked(text: str, *, source: Path, page: Path, anchors: set[str], where: str) -> str:
    """The text's relative links, written relative to `source`'s folder, made to work
    from `page`: a docs page is linked from the page's folder; any other file of the
    repository (not on the site) becomes its path; an anchor of another runbook stays."""

    def relink(match: re.Match[str]) -> str:
        bang, label, target = match.group("bang", "label", "target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            return match.group(0)  # a URL
        path, _, fragment = target.partition("#")
        if not path and fragment in anchors:
            return match.group(0)  # another runbook: a section of the page too
        resolved = (source.parent / path).resolve() if path else source.resolve()
        if not resolved.exists():
            raise ValueError(f"{where}: the link {target!r} points at nothing in the repository")
        docs = REPO / "docs"
        if resolved.suffix == ".md" and resolved.is_relative_to(docs) and not bang:
            relative = Path(os.path.relpath(resolved, page.parent)).as_posix()
            return f"[{label}]({relative}{'#' + fragment if fragment else ''})"
        in_repo = resolved.relative_to(REPO).as_posix() + (f"#{fragment}" if fragment else "")
        return f"{label} ({_code(in_repo)})"

    def outside_code(match: re.Match[str]) -> str:
        return match.group(0) if match.group("code") else relink(match)

    return _LINK.sub(outside_code, text)


def runbooks_markdown(
    alerts_path: Path = ALERTS, readme: Path = DEPLOY_README, page: Path = RUNBOOKS_PAGE
) -> str:
    """One section per alert of relay-alerts.yml, in file order: its severity, `for:`
    and expression, then its runbook from deploy/README.md (the source of truth)."""
    runbooks = runbook_sections(readme)
    rules = alerts(alerts_path)
    anchors = {rule.name.lower() for rule in rules}
    lines: list[str] = []
    for rule in rules:
        if rule.name not in runbooks:
            raise ValueError(
                f"alert {rule.name} of {_shown(alerts_path)} has no runbook: add a "
                f"'### {rule.name}' subsection under '## Runbooks' in {_shown(readme)}"
            )
        when = (
            f"after the condition holds for {rule.for_}"
            if rule.for_
            else "as soon as the condition holds"
        )
        body = _relinked(
            runbooks[rule.name],
            source=readme,
            page=page,
            anchors=anchors,
            where=f"{_shown(readme)}, ### {rule.name}",
        )
        lines += [f"## {rule.name}", "", f"Severity **{rule.severity}**; fires {when}.", ""]
        lines += ["```text", rule.expr, "```", "", body, ""]
    return "\n".join(lines)


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_markdown,
    "cli": cli_markdown,
    "metrics": metrics_markdown,
    "runbooks": runbooks_markdown,
}


# --- Sphinx ---


def _fill_references(app: Sphinx, docname: str, source: list[str]) -> None:
    def generated(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{docname}: no generated reference named {name!r}")
        return GENERATORS[name]()

    source[0] = MARKER.sub(generated, source[0])


_TOCTREE = re.compile(r"^(```+|:::+)\{toctree\}[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_GLOB = re.compile(r"[*?\[]")


def _drop_empty_globs(app: Sphinx, docname: str, source: list[str]) -> None:
    """A `:glob:` entry of a toctree that matches no page yet is left out, not warned
    about: a section's folder may still be empty."""
    from sphinx.util import docname_join
    from sphinx.util.matching import patfilter

    found = sorted(app.env.found_docs)

    def keep(entry: str) -> bool:
        entry = entry.strip()
        if not entry or entry.startswith(":") or not _GLOB.search(entry):
            return True
        return bool(patfilter(found, docname_join(docname, entry)))

    def filtered(match: re.Match[str]) -> str:
        body = "".join(line for line in match.group(2).splitlines(keepends=True) if keep(line))
        head = match.group(0)[: match.start(2) - match.start(0)]
        return head + body + match.group(1)

    source[0] = _TOCTREE.sub(filtered, source[0])


def _always_regenerate(
    app: Sphinx, env: BuildEnvironment, added: set[str], changed: set[str], removed: set[str]
) -> list[str]:
    """The reference pages change with the code, not with their Markdown: read them
    again on every build."""
    pages = []
    for docname in env.found_docs:
        path = Path(env.doc2path(docname))
        if path.suffix == ".md" and MARKER.search(path.read_text(encoding="utf-8")):
            pages.append(docname)
    return pages


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("source-read", _fill_references)
    app.connect("source-read", _drop_empty_globs)
    app.connect("env-get-outdated", _always_regenerate)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
