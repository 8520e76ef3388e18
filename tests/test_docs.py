"""The docs site (docs/): its generated references cover the code, and it builds with
warnings as errors into pages that load nothing from the network.

The references are made by docs/_ext/relay_reference.py; these tests look at the code
their own way (the settings models, the argument parser, the metric calls in the
source) so a setting, command, option or metric the reference misses fails here, and
so does one without a description.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from relay.admin.cli import build_parser
from relay.console import settings as console_settings
from relay.settings import SECRET_FIELDS, Settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


@functools.cache
def reference() -> ModuleType:
    """docs/_ext/relay_reference.py, the extension the site is built with."""
    path = DOCS / "_ext" / "relay_reference.py"
    spec = importlib.util.spec_from_file_location("relay_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _blocks(markdown: str, level: str) -> dict[str, str]:
    """Each heading `### `NAME`` of `level` (e.g. "###") -> the text up to the next
    heading of any level."""
    found: dict[str, str] = {}
    parts = re.split(r"^(#+ .*)$", markdown, flags=re.MULTILINE)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        match = re.fullmatch(rf"{re.escape(level)} `([^`]+)`", heading.strip())
        if match:
            assert match[1] not in found, f"{match[1]} is listed twice"
            found[match[1]] = body
    return found


# --- settings ---


def _setting_fields() -> dict[str, Any]:
    """Every settings variable -> its pydantic field, from the models themselves."""
    fields = {f"RELAY_{name.upper()}": info for name, info in Settings.model_fields.items()}
    prefix = console_settings.PREFIX
    model = console_settings.ConsoleSettings
    fields |= {f"{prefix}{name.upper()}": info for name, info in model.model_fields.items()}
    return fields


def test_the_settings_reference_lists_every_setting_once() -> None:
    listed = _blocks(reference().settings_markdown(), "###")
    expected = set(_setting_fields())
    assert expected - set(listed) == set(), "settings missing from the reference"
    assert set(listed) - expected == set(), "the reference lists what is no setting"


def test_the_settings_reference_names_every_file_form_of_a_secret() -> None:
    listed = _blocks(reference().settings_markdown(), "###")
    files = {f"RELAY_{name.upper()}": f"RELAY_{name.upper()}_FILE" for name in SECRET_FIELDS}
    prefix = console_settings.PREFIX
    files |= {f"{prefix}{n.upper()}": f"{prefix}{n.upper()}_FILE" for n in console_settings.SECRETS}
    for variable, file_variable in files.items():
        assert f"`{file_variable}`" in listed[variable], variable
        assert "**Secret:** yes" in listed[variable], variable
    for variable, info in _setting_fields().items():
        if "SecretStr" in str(info.annotation):
            assert "**Secret:** yes" in listed[variable], variable
        elif variable not in files:
            assert "**Secret:**" not in listed[variable], variable


def _numbers(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_the_settings_reference_shows_each_type_default_and_bound() -> None:
    listed = _blocks(reference().settings_markdown(), "###")
    for variable, info in _setting_fields().items():
        facts = listed[variable]
        assert "**Type:**" in facts, variable
        assert "**Default:**" in facts, variable
        default = info.default
        if isinstance(default, bool):
            assert f"`{str(default).lower()}`" in facts, variable
        elif isinstance(default, int | float | str) and default != "":
            assert f"`{default}`" in facts, variable
        for meta in info.metadata:
            for bound in ("ge", "gt", "le", "lt", "min_length", "max_length"):
                value = getattr(meta, bound, None)
                if value is not None:
                    assert _numbers(value) in facts.split("**Bounds:**")[1], (variable, bound)
            if getattr(meta, "pattern", None):
                assert meta.pattern in facts, variable
        if "Literal" in str(info.annotation):
            for choice in re.findall(r"'([^']+)'", str(info.annotation)):
                assert f"`{choice}`" in facts, (variable, choice)
    shards = listed["RELAY_SHARDS"]
    assert "integer" in shards and "`1`" in shards and "≥ 1, ≤ 256" in shards


def test_every_setting_has_a_description() -> None:
    """A setting without a description fails here: give it Field(description=...)."""
    undocumented_mark = reference().UNDOCUMENTED
    listed = _blocks(reference().settings_markdown(), "###")
    undescribed = {v for v, info in _setting_fields().items() if not info.description}
    marked = {v for v, text in listed.items() if undocumented_mark in text}
    assert marked == undescribed
    missing = sorted(undescribed)
    assert not missing, f"describe these settings: Field(description=...): {missing}"


# --- command line ---


def _commands(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, list[argparse.Action]]]:
    actions = [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
    ]
    yield path, actions
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, f"{path} {name}")


def test_the_cli_reference_lists_every_command_and_option() -> None:
    markdown = reference().cli_markdown()
    listed = {**_blocks(markdown, "##"), **_blocks(markdown, "###"), **_blocks(markdown, "####")}
    commands = dict(_commands(build_parser(), "relay"))
    assert set(commands) == set(listed)
    assert {"relay run", "relay migrate", "relay dead-letter requeue"} <= set(listed)
    unhelped = set()
    for command, actions in commands.items():
        for action in actions:
            names = action.option_strings or [str(action.metavar or action.dest)]
            for name in names:
                assert re.search(rf"^`{re.escape(name)}`", listed[command], re.M), (command, name)
            if not action.help:
                unhelped.add(f"{command} {names[0]}")
            if action.choices:
                for choice in action.choices:
                    assert f"`{choice}`" in listed[command], (command, choice)
    undocumented = sum(text.count(reference().UNDOCUMENTED) for text in listed.values())
    assert undocumented == len(unhelped)
    assert not unhelped, f"give these options a help= text: {sorted(unhelped)}"


# --- metrics ---

_METRIC_CALLS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "BatchHistogram"}
_FAMILIES = {
    "CounterMetricFamily": "counter",
    "GaugeMetricFamily": "gauge",
    "HistogramMetricFamily": "histogram",
    "SummaryMetricFamily": "summary",
    "InfoMetricFamily": "info",
}


def _metrics_in_source() -> dict[str, tuple[str, ...]]:
    """Every metric the relay's source defines, by its scraped name -> the label names
    written beside it (prometheus_client objects, families and collectors' Metric)."""
    found: dict[str, tuple[str, ...]] = {}
    for path in sorted((REPO / "relay").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "prometheus_client" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            name = first.value
            labels: tuple[str, ...] = ()
            if called in _METRIC_CALLS:
                kind = {"Counter": "counter", "Info": "info"}.get(called, "")
                label_node = node.args[2] if len(node.args) > 2 else None
                for keyword in node.keywords:
                    if keyword.arg == "labelnames":
                        label_node = keyword.value
                if isinstance(label_node, ast.List | ast.Tuple):
                    labels = tuple(ast.literal_eval(label_node))
                elif isinstance(label_node, ast.Constant) and called == "BatchHistogram":
                    labels = (str(label_node.value),)
            elif called == "Metric" and len(node.args) > 2:
                kind = ast.literal_eval(node.args[2])
            elif called in _FAMILIES:
                kind = _FAMILIES[called]
            else:
                continue
            suffix = {"counter": "_total", "info": "_info"}.get(kind, "")
            found[name.removesuffix("_total") + suffix] = labels
    return found


def test_the_metrics_reference_lists_every_metric_of_the_source() -> None:
    listed = _blocks(reference().metrics_markdown(), "###")
    in_source = _metrics_in_source()
    assert len(in_source) > 40  # the scan sees the metrics
    for name, labels in in_source.items():
        assert name in listed, f"{name} is missing from the metrics reference"
        for label in labels:
            assert f"`{label}`" in listed[name].split("**Labels:**")[1], (name, label)
        assert "**Type:**" in listed[name], name


def test_the_metrics_reference_lists_every_metric_in_the_registry() -> None:
    listed = _blocks(reference().metrics_markdown(), "###")
    for path in sorted((REPO / "relay").rglob("*.py")):
        if "prometheus_client" in path.read_text(encoding="utf-8"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            if not module.endswith("__main__"):
                importlib.import_module(module)
    for family in REGISTRY.collect():
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        assert family.name + suffix in listed, family.name
        assert f"**Type:** {family.type}" in listed[family.name + suffix]


def test_every_metric_has_help_and_known_labels() -> None:
    markdown = reference().metrics_markdown()
    assert reference().UNDOCUMENTED not in markdown


# --- the runbooks ---


def unlinked(markdown: str) -> str:
    """Markdown with its links as their text, and a repository path the runbooks page
    puts after a link's text, ` (`deploy/<file>`)`, left out."""
    text = re.sub(r"\[([^\]]*)\]\([^()\s]*\)", r"\1", markdown)
    return re.sub(r" \(`[\w.-]+/[\w./#-]*`\)", "", text)


def test_the_runbooks_page_has_every_alert_with_its_runbook() -> None:
    rules = yaml.safe_load((REPO / "deploy" / "monitoring" / "relay-alerts.yml").read_text())
    names = [r["alert"] for group in rules["groups"] for r in group["rules"] if "alert" in r]
    readme = (REPO / "deploy" / "README.md").read_text(encoding="utf-8")
    runbooks = readme[readme.index("\n## Runbooks\n") :]
    page = reference().runbooks_markdown()
    headings = re.findall(r"^## (\w+)$", page, flags=re.MULTILINE)
    assert headings == names, "one section per alert, in the rules' order"
    sections = dict(zip(headings, re.split(r"^## \w+$", page, flags=re.MULTILINE)[1:], strict=True))
    for name in names:
        start = runbooks.index(f"\n### {name}\n") + len(f"\n### {name}\n")
        end = re.compile(r"^##", re.MULTILINE).search(runbooks, start)
        body = runbooks[start : end.start() if end else None].strip()
        # The whole runbook, its links aside (made to work from docs/operations/).
        assert unlinked(body) in unlinked(sections[name]), f"{name}: runbook not on the page"
        assert "Severity **" in sections[name] and "```text\n" in sections[name]
    # Every relative link of the page leads to a file from docs/operations/.
    for target in re.findall(r"\]\(([^()\s]+)\)", page):
        path = target.partition("#")[0]
        if path and not re.match(r"[a-z]+:", path):
            assert (DOCS / "operations" / path).is_file(), f"{target} leads nowhere"
    # The page source keeps only its introduction and the marker.
    source = (DOCS / "operations" / "runbooks.md").read_text(encoding="utf-8")
    assert "<!-- relay-reference: runbooks -->" in source
    assert not re.search(r"^## ", source, flags=re.MULTILINE)


def test_an_alert_without_a_runbook_fails_the_runbooks_page(tmp_path: Path) -> None:
    rules = tmp_path / "alerts.yml"
    rules.write_text(
        "groups:\n  - name: relay\n    rules:\n"
        "      - alert: RelayDown\n        expr: up == 0\n        for: 2m\n"
        "        labels: {severity: warning}\n"
        "      - alert: RelayForgotten\n        expr: vector(1)\n"
        "        labels: {severity: critical}\n"
    )
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Deploying\n\n## Runbooks\n\n### RelayDown\n\n*Down.*\n\n"
        "## Other\n\n### RelayForgotten\n\nNot a runbook: outside *Runbooks*.\n"
    )
    page = tmp_path / "docs" / "operations" / "runbooks.md"
    with pytest.raises(
        ValueError, match=r"alert RelayForgotten .* has no runbook.*### RelayForgotten"
    ):
        reference().runbooks_markdown(rules, readme, page)
    readme.write_text(readme.read_text().replace("## Other\n\n", ""))
    made = reference().runbooks_markdown(rules, readme, page)
    assert "## RelayDown\n\nSeverity **warning**; fires after the condition holds for 2m." in made
    assert "Severity **critical**; fires as soon as the condition holds." in made
    assert "```text\nvector(1)\n```\n\nNot a runbook" in made
