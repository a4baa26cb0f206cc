"""What the docs name exists: config keys (with the defaults they state), metric families, make targets and files.

The README and docs/*.md are read as an operator reads them; a renamed key, a changed default, a dropped metric or
a moved file fails here instead of leaving the docs pointing at nothing."""

import ast
import itertools
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from aiohttp.test_utils import make_mocked_request
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from backends import registry
from gateway.app import create_app
from gateway.config import GatewayConfig, PoolConfig, TelemetryConfig
from gateway.observe.metrics import GatewayMetrics
from loadtests.fleet import gateway_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Per-pool sections the docs name without the `pools[].` in front.
POOL_SECTIONS = {"health", "outlier", "retry", "discovery"}
# Files the docs name that are not the repository's: TensorRT-LLM's converter the Triton driver follows, and the
# lock file serve --workers creates at run time.
NOT_REPOSITORY_FILES = {"hf_lora_convert.py", "scrapes.lock"}


def doc_matches(pattern: str) -> list[tuple[str, re.Match[str]]]:
    """Every match of pattern in the docs, with 'file:line' for the failure message."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(pattern, text):
            found.append((f"{path.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}", match))
    return found


def nested_model(annotation: object) -> type[BaseModel] | None:
    """The pydantic model a field holds, through Optional, list[...] and dict[..., ...]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        model = nested_model(argument)
        if model is not None:
            return model
    return None


def config_field(dotted: str) -> FieldInfo | type[BaseModel] | None:
    """The field (or section) a dotted config key names, or None where the config has no such key."""
    parts = dotted.replace("[]", "").split(".")
    current: type[BaseModel] | None = PoolConfig if parts[0] in POOL_SECTIONS else GatewayConfig
    field: FieldInfo | None = None
    for part in parts:
        if current is None or part not in current.model_fields:
            return None
        field = current.model_fields[part]
        current = nested_model(field.annotation)
    return current if current is not None else field


def config_keys() -> list[tuple[str, re.Match[str]]]:
    sections = "|".join(sorted(set(GatewayConfig.model_fields) | POOL_SECTIONS))
    # The default stated after a key: `residency.fill_wait_s` (30 s), or `residency.use_flush_interval_s`, 0.25 s.
    return doc_matches(rf"`((?:{sections})(?:\[\])?(?:\.[a-z_]+(?:\[\])?)+)`(?:\s*\(([^)]*)\)|,\s*(\d[^,;)]*))?")


def test_every_config_key_the_docs_name_exists() -> None:
    found = config_keys()
    assert len(found) > 50  # the pattern finds the docs' keys: the check is not vacuous
    missing = [f"{where} {match.group(1)}" for where, match in found if config_field(match.group(1)) is None]
    assert not missing, missing


def stated_default(text: str) -> float | None:
    """The figure a '(...)' after a key states as its default: '10 s', '2,000', '10%', '0.25 s; ...', '0 by default'."""
    match = re.match(r"(\d[\d,]*(?:\.\d+)?)\s*(%|s\b|ms\b)?(?:[;,:]|$| by default)", text.strip())
    if match is None:
        return None
    value = float(match.group(1).replace(",", ""))
    return value / 100 if match.group(2) == "%" else value


def test_every_default_the_docs_state_after_a_key_is_the_configs() -> None:
    checked, wrong = 0, []
    for where, match in config_keys():
        field = config_field(match.group(1))
        stated = stated_default(match.group(2) or (match.group(3) or "").strip() + ";")
        if stated is None or not isinstance(field, FieldInfo):
            continue
        checked += 1
        if field.default != pytest.approx(stated):
            wrong.append(f"{where} {match.group(1)}: docs say {stated}, the config's default is {field.default}")
    assert checked >= 20 and not wrong, wrong


def test_every_metric_the_docs_name_is_one_the_gateway_declares() -> None:
    source = "".join(path.read_text() for path in (REPO / "gateway").rglob("*.py"))
    declared = set(re.findall(r"[\"'](tenantgate_[a-z_]+)[\"']", source))
    missing = []
    for where, match in doc_matches(r"tenantgate_[a-z_]+"):
        name = match.group(0)
        # The name a query uses: a counter's _total, a histogram's series, an Info's _info; 'x_' names a prefix.
        bases = {name, re.sub(r"_(total|bucket|sum|count|info)$", "", name)}
        if not bases & declared and not (name.endswith("_") and any(d.startswith(name) for d in declared)):
            missing.append(f"{where} {name}")
    assert len(declared) > 40 and not missing, missing


def test_every_make_target_the_docs_name_is_in_the_makefile() -> None:
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):(?!=)", (REPO / "Makefile").read_text(), re.MULTILINE))
    named = doc_matches(r"`make ([a-z][a-z0-9-]*)")
    missing = [f"{where} make {match.group(1)}" for where, match in named if match.group(1) not in targets]
    # `make bench-overhead --only tenantgate` is make's own option error, not the benchmark's --only: a target's
    # recipe takes no flags (its module's do: `python -m loadtests.bench_overhead --only ...`).
    flagged = doc_matches(r"`make [a-z][a-z0-9-]*[^`\n]*? (--[a-z][a-z-]*)")
    missing += [f"{where} {match.group(0)}: make takes no {match.group(1)}" for where, match in flagged]
    assert len(named) > 20 and not missing, missing


def test_every_repository_file_the_docs_name_exists() -> None:
    """A path with a directory is looked up from the repository's root or the doc's folder; a path given inside a
    package's context (`routing/costs.py`, `placer.py`) must end some file of the repository."""
    files = [
        path.relative_to(REPO).as_posix()
        for top in ("gateway", "backends", "loadtests", "tests", "deploy", "docs", "requirements")
        for path in (REPO / top).rglob("*")
    ]
    missing = []
    for where, match in doc_matches(r"`([A-Za-z0-9_./-]+\.(?:py|md|yaml|yml|lock|toml|json))`"):
        name = match.group(1)
        if name in NOT_REPOSITORY_FILES:
            continue
        doc_folder = (REPO / where.split(":")[0]).parent
        if (REPO / name).exists() or (doc_folder / name).exists():
            continue
        if not any(file == name or file.endswith("/" + name) for file in files):
            missing.append(f"{where} {name}")
    assert not missing, missing


def leaf_fields() -> dict[str, list[FieldInfo]]:
    """Every plain (non-section) field of the config and of each registered engine's pool section, by name."""
    leaves: dict[str, list[FieldInfo]] = {}
    seen: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            section = nested_model(field.annotation)
            if section is None:
                leaves.setdefault(name, []).append(field)
            else:
                walk(section)

    walk(GatewayConfig)
    for engine in registry.names():
        walk(registry.spec(engine).settings)
    return leaves


def test_every_default_the_docs_state_after_a_bare_key_is_the_configs() -> None:
    """`capacity_floor` (default 8), `idle_evict_s` (600 s): a key named without its section, where only one model of
    the config has a field of that name."""
    leaves = leaf_fields()
    checked, wrong = 0, []
    for where, match in doc_matches(r"`([a-z_]+)`\s*\((?:default\s+)?([^)]*)\)"):
        fields = leaves.get(match.group(1), [])
        stated = stated_default(match.group(2))
        default = fields[0].default if len(fields) == 1 else None
        # '(413)' after `max_body_bytes` is the status it answers, not its default.
        status_code = re.fullmatch(r"[45]\d\d", match.group(2).strip()) is not None
        if not isinstance(default, int | float) or isinstance(default, bool) or stated is None or status_code:
            continue
        checked += 1
        if default != pytest.approx(stated):
            wrong.append(f"{where} {match.group(1)}: docs say {stated}, the config's default is {default}")
    assert checked >= 15 and not wrong, wrong


def named_fields(name: str, leaves: dict[str, list[FieldInfo]]) -> list[FieldInfo]:
    """The fields a key the docs name stands for: a dotted key's one field, a bare name's fields where the config
    has that name (several where sections share it, as `policy`)."""
    if "." in name or name in GatewayConfig.model_fields:
        field = config_field(name)
        return [field] if isinstance(field, FieldInfo) else []
    return leaves.get(name, [])


def test_every_switch_the_docs_call_on_or_off_by_default_is() -> None:
    """`residency.fill_warm_up` (on by default), (`pools[].cache_salt`, on by default), `eviction`, off by default
    (a scorer: on when `routing.scorers` names it), `confine_spills` (on: ...): the default is what the docs say, so
    a default turned on or off fails here until the docs follow."""
    from gateway.config import RoutingConfig
    from gateway.routing.scorers import SCORERS

    scorers_on = RoutingConfig().scorers
    leaves, checked, wrong = leaf_fields(), 0, []
    # 'off by\ndefault': a line break is a space.
    switches = r"`([a-z_]+(?:\[\])?(?:\.[a-z_]+)*)`(?:(?:\s\(|,\s)(on|off)\s+by\s+default|\s\((on|off)[:;])"
    for where, match in doc_matches(switches):
        name, said = match.group(1), match.group(2) or match.group(3)
        on = said == "on"
        if name == "routing.scorers":
            continue  # "An `eviction` scorer (`routing.scorers`, off by default": the scorer's, checked by its name
        checked += 1
        if name in SCORERS:
            if (scorers_on.get(name, 0) > 0) != on:
                wrong.append(f"{where} scorer {name}: {said} by default")
            continue
        fields = named_fields(name, leaves)
        assert fields and all(f.annotation is bool for f in fields), f"{where} {name}: not a switch"
        wrong += [f"{where} {name}: {said} by default" for f in fields if f.default != on]
    assert checked >= 4 and not wrong, wrong


def test_every_choice_the_docs_call_the_default_is_its_keys_default() -> None:
    """`routing.load_view`: `shared` (default), `predicted_ttft` (default): the value named is the default of the
    key whose choices it is (each key of that name, where sections share one)."""
    leaves, checked, wrong = leaf_fields(), 0, []
    for where, match in doc_matches(r"`([a-z_]+)` \(default\)"):
        value = match.group(1)
        keys = [name for name, fields in leaves.items() if all(value in typing.get_args(f.annotation) for f in fields)]
        assert len(keys) == 1, f"{where} {value}: the choice of {keys or 'no key'}"
        checked += 1
        wrong += [
            f"{where} {keys[0]}: {value} is not its default ({f.default})"
            for f in leaves[keys[0]]
            if f.default != value
        ]
    assert checked >= 2 and not wrong, wrong


def test_the_runbooks_metric_table_gives_each_recorded_metrics_type_and_labels() -> None:
    """docs/operations.md, Every metric: a row's type and labels are those gateway/observe/metrics.py declares (the
    families read at scrape time, declared by the fleet's and placement's collectors, are checked by name above)."""
    metrics = GatewayMetrics()
    declared = {
        metric._name: (metric._type, set(metric._labelnames))
        for metric in vars(metrics).values()
        if isinstance(metric, Counter | Gauge | Histogram)
    }
    runbook = (REPO / "docs/operations.md").read_text()
    checked, wrong = 0, []
    for row in re.finditer(r"^\| (`tenantgate_[^|]+) \| ([^|]+) \| ([^|]*) \|", runbook, re.MULTILINE):
        kind, labels = row.group(2).strip(), {label.strip() for label in row.group(3).split(",") if label.strip()}
        for name in re.findall(r"`(tenantgate_[a-z_]+)`", row.group(1)):
            found = declared.get(re.sub(r"_total$", "", name))
            if found is None:
                continue
            checked += 1
            if not kind.startswith(found[0]) or labels != found[1]:
                wrong.append(
                    f"{name}: the runbook says {kind} {sorted(labels)}, metrics.py {found[0]} {sorted(found[1])}"
                )
    assert checked >= 20 and not wrong, wrong


def code_strings() -> set[str]:
    """Every string constant in gateway/ and backends/: the label values and names the code can write."""
    return {
        node.value
        for top in ("gateway", "backends")
        for path in (REPO / top).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_every_label_and_value_the_docs_give_a_metric_is_the_codes() -> None:
    """`tenantgate_adapter_evictions_total{trigger="over_bound"}`, `...{outcome=waited|over|refused}`,
    `...{pool, replica}`: each label is one the metric declares (for gateway/observe/metrics.py's), and each value is a
    string the code writes (a literal of gateway/ or backends/): a renamed trigger or reason fails here."""
    metrics = GatewayMetrics()
    declared = {
        metric._name: set(metric._labelnames)
        for metric in vars(metrics).values()
        if isinstance(metric, Counter | Gauge | Histogram)
    }
    literals = code_strings()
    named, wrong, values = doc_matches(r"`(tenantgate_[a-z_]+)\{([^}]*)\}`"), [], 0
    for where, match in named:
        labels = declared.get(re.sub(r"_total$", "", match.group(1)))
        for pair in match.group(2).split(","):
            label, _, given = pair.strip().partition("=")
            if labels is not None and label not in labels:
                wrong.append(f"{where} {match.group(1)}: no label {label} (it has {sorted(labels)})")
            for value in filter(None, given.strip('"').split("|")):
                values += 1
                if value not in literals:
                    wrong.append(f"{where} {match.group(1)}: {label}={value} is nothing the code writes")
    assert len(named) >= 10 and values >= 8 and not wrong, wrong


def test_the_runbooks_metric_table_has_a_row_for_every_metric_the_gateway_exports() -> None:
    """docs/operations.md, Every metric: the other direction of the checks above: each family the gateway's code
    names (metrics.py's, and those its collectors build at scrape time) has a row, so a new metric is documented."""
    source = "".join(path.read_text() for path in (REPO / "gateway").rglob("*.py"))
    named = set(re.findall(r"[\"'](tenantgate_[a-z_]+)[\"']", source)) - {"tenantgate_session"}  # the admin cookie
    runbook = (REPO / "docs/operations.md").read_text()
    rows = {
        re.sub(r"_(total|info)$", "", name)
        for row in re.finditer(r"^\| (`tenantgate_[^|]+) \|", runbook, re.MULTILINE)
        for name in re.findall(r"`(tenantgate_[a-z_]+)`", row.group(1))
    }
    missing = sorted(name for name in named if name not in rows)
    assert len(named) > 50 and not missing, missing


def test_every_label_value_the_runbooks_metric_table_names_is_one_the_code_writes() -> None:
    """docs/operations.md, Every metric: a row's description names the values its labels take in backticks
    (evictions' `request_path`, `scheduled` or `over_bound`; ejections' `several_tenants`); each is a string the code
    writes, unless it is one of the row's labels, a metric or a config key."""
    literals = code_strings()
    keys = leaf_fields().keys()
    runbook = (REPO / "docs/operations.md").read_text()
    checked, wrong = 0, []
    for row in re.finditer(r"^\| (`tenantgate_[^|]+) \| [^|]+ \| ([^|]*) \| (.*)\|$", runbook, re.MULTILINE):
        labels = {label.strip() for label in row.group(2).split(",")}
        for value in re.findall(r"`([a-z_:]+)`", row.group(3)):
            if value in labels or value in keys or value.startswith("tenantgate_"):
                continue
            checked += 1
            if value not in literals:
                wrong.append(f"{row.group(1).split()[0]}: {value} is nothing the code writes")
    assert checked >= 30 and not wrong, wrong


def command_lines(program: str, inline: bool) -> list[tuple[str, str]]:
    """Each line of the docs' shell blocks (and, with ``inline``, of their inline code) that runs ``program``:
    from the program on, up to a pipe or a comment, continuation lines joined."""
    found = []
    pattern = r"(?s:```sh\n(.*?)```)" + (r"|`((?:[^`\n]|\n(?![\n`]))+)`" if inline else "")
    for where, match in doc_matches(pattern):
        # A shell block's lines are its commands; inline code is one, whatever line breaks the paragraph put in it.
        code = match.group(1).replace("\\\n", " ") if match.group(1) else " ".join(match.group(2).split())
        for line in code.splitlines():
            command = re.search(rf"(?:^|\| |[A-Z_]+=\S* )({re.escape(program)} .*?)(?:\s+#.*)?$", line.strip())
            if command:
                found.append((where, command.group(1).split(" | ")[0]))
    return found


def test_every_tenantgate_command_the_docs_give_parses(capsys: pytest.CaptureFixture[str]) -> None:
    """The shell blocks' command lines parse whole; an inline mention ('`tenantgate serve --workers N`') may leave
    out a required argument but names only subcommands and flags the CLI has."""
    from gateway.cli import _build_parser

    whole = set(command_lines("tenantgate", inline=False))
    commands = sorted(set(command_lines("tenantgate", inline=True)) | whole)
    failed = []
    for where, line in commands:
        args = shlex.split(re.sub(r"\bN\b", "2", line))[1:]  # '--workers N'
        if (where, line) not in whole and not re.fullmatch(r"-.*|[a-z]+(-[a-z]+)*", args[0]):
            continue  # a benchmark setup's name ('tenantgate predicted_ttft, traffic homes'), not a command
        try:
            _build_parser().parse_args(args)
        except SystemExit as exc:  # argparse's refusal (or --version's exit 0, which is fine)
            refusal = capsys.readouterr().err
            if exc.code and ((where, line) in whole or "the following arguments are required" not in refusal):
                failed.append(f"{where} {line}: {refusal.strip().splitlines()[-1]}")
    assert len(whole) >= 5 and len(commands) >= 20 and not failed, failed


def test_every_flag_the_docs_pass_a_benchmark_module_is_one_it_takes() -> None:
    runs: dict[str, set[str]] = {}
    for _where, line in command_lines("python -m", inline=True):
        named = re.match(r"python -m (loadtests\.[a-z_.]+)", line)
        if named:
            runs.setdefault(named.group(1), set()).update(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
    unknown = []
    for module, flags in runs.items():
        if not flags:
            continue
        usage = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert usage.returncode == 0, usage.stderr
        unknown += [f"{module} {flag}" for flag in sorted(flags) if flag not in usage.stdout]
    assert len(runs) >= 5 and not unknown, unknown


def test_every_link_between_the_docs_lands() -> None:
    """A relative Markdown link (or image) names a file of the repository, and its #anchor one of that file's
    headings, as GitHub makes anchors (lower case, punctuation dropped, spaces to hyphens)."""
    broken, links = [], doc_matches(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)")
    for where, match in links:
        target, anchor = match.group(1), match.group(2)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (REPO / where.split(":")[0]).parent / target if target else REPO / where.split(":")[0]
        if not path.exists():
            broken.append(f"{where} {target}")
        elif anchor:
            headings = re.findall(r"^#+\s+(.*)$", path.read_text(), re.MULTILINE)
            anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
            if anchor not in anchors:
                broken.append(f"{where} {target}#{anchor}")
    assert len(links) >= 5 and not broken, broken


async def test_every_gateway_endpoint_the_docs_name_is_routed() -> None:
    """`POST /admin/placement/freeze`, `DELETE /admin/keys/sha256:<hex>`, ...: the gateway's app routes each method
    and path the docs name ({placeholders} and '...' filled in; 'drain|undrain' is both). The simulator's own
    routes (/sim/) and Triton's (/v2/) are the engines', not the gateway's."""
    config = gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["a1"]}, {"a1": "/srv/loras/a1"}, port=0)
    app = create_app(GatewayConfig.model_validate(config))
    named, unrouted = doc_matches(r"`(GET|POST|PUT|DELETE)\s+(/[^`\s?]+)"), []
    for where, match in named:
        method, path = match.group(1), match.group(2)
        if path.startswith(("/sim/", "/v2/")):
            continue
        path = re.sub(r"\{[^}]+\}", "x", path).replace("sha256:...", "sha256:" + "0" * 64).replace("<hex>", "0" * 64)
        head, _, last = path.rpartition("/")
        for one in (f"{head}/{choice}" for choice in last.split("|")):
            resolved = await app.router.resolve(make_mocked_request(method, one, app=app))
            if resolved.http_exception is not None:
                unrouted.append(f"{where} {method} {one}: {resolved.http_exception.status}")
    assert len(named) > 40 and not unrouted, unrouted


def last_field(dotted: str) -> FieldInfo:
    """The field a dotted config key ends on (a section's own field, not the model it holds)."""
    *sections, name = dotted.split(".")
    model = config_field(".".join(sections)) if sections else GatewayConfig
    if name in POOL_SECTIONS and not sections:
        model = PoolConfig
    assert isinstance(model, type) and issubclass(model, BaseModel), dotted
    return model.model_fields[name]


def test_every_config_snippet_in_the_docs_is_valid_config() -> None:
    """`auth: {trusted_header: X-Tenant-ID, ...}`, `splits: [{name: ..., variants: [...]}]`, `retry: {budget_ratio:
    0.2, min_per_s: 3}` validate as that section; `health: {interval_s, timeout_s, ...}` (keys without values)
    names only keys the section has; and docs/triton.md's example pool is a valid pool."""
    sections = "|".join(sorted(set(GatewayConfig.model_fields) | POOL_SECTIONS))
    snippets, invalid = doc_matches(rf"`((?:{sections})(?:\.[a-z_]+)*): ([\[{{][^`]*)`"), []
    for where, match in snippets:
        key, value = match.group(1), yaml.safe_load(match.group(2))
        field = last_field(key)
        if isinstance(value, dict) and all(v is None for v in value.values()):
            model = nested_model(field.annotation)
            assert model is not None, f"{where} {key}"
            invalid += [f"{where} {key}: no key {name}" for name in value if name not in model.model_fields]
            continue
        assert field.annotation is not None, key
        try:
            TypeAdapter(field.annotation).validate_python(value)
        except ValidationError as exc:
            invalid.append(f"{where} {key}: {exc}")
    assert len(snippets) >= 10 and not invalid, invalid
    [example] = re.findall(r"```yaml\n(.*?)```", (REPO / "docs/triton.md").read_text(), re.DOTALL)
    [pool] = yaml.safe_load(example)["pools"]
    tenant = {"id": "acme", "api_keys": ["sha256:" + "0" * 64], "base_models": [pool["base_model"]]}
    assert GatewayConfig.model_validate({"pools": [pool], "tenants": [tenant]}).pools[0].backend == "triton"


def test_the_runbook_answers_every_alert_with_its_duration() -> None:
    """docs/operations.md, "Respond to each alert": one entry per rule of deploy/observability/alerts.yaml, none for a
    rule that does not exist, and the duration an entry states ('for 10 min', ', 1 min)') is the rule's `for`."""
    alerts = yaml.safe_load((REPO / "deploy/observability/alerts.yaml").read_text())
    rules = {rule["alert"]: rule for group in alerts["groups"] for rule in group["rules"]}
    runbook = (REPO / "docs/operations.md").read_text()
    section = runbook[runbook.index("## Respond to each alert") :]
    section = section[: section.index("\n## ")]
    entries = {
        name: " ".join(text.split())
        for name, text in re.findall(
            r"^- \*\*(Tenantgate[A-Za-z]+)\*\*(.*?)(?=^- |\Z)", section, re.MULTILINE | re.DOTALL
        )
    }
    assert set(entries) == set(rules), set(entries) ^ set(rules)
    stated = {name: re.match(r"\(([^)]*)\)", text) for name, text in entries.items()}
    checked, wrong = 0, []
    for name, summary in stated.items():
        minutes = re.search(r"(\d+) min\b", summary.group(1)) if summary else None
        if minutes is None:
            continue
        checked += 1
        if rules[name]["for"] != f"{minutes.group(1)}m":
            wrong.append(f"{name}: the runbook says {minutes.group(1)} min, the rule waits {rules[name]['for']}")
    assert checked >= 5 and not wrong, wrong


def test_every_setup_variant_and_trace_the_docs_run_exists() -> None:
    """`python -m loadtests.bench_routing --trace collide --only "=tenantgate predicted_ttft|..."`: each trace, each
    setup an --only selects (an '=name' exactly, else some setup's name containing it) and each bench_residency
    --variant is one the module has."""
    from loadtests.bench_residency import VARIANTS
    from loadtests.bench_routing import SETUPS, TRACES

    names, unknown, checked = [s.name for s in SETUPS], [], 0
    for where, line in command_lines("python -m", inline=True):
        args = shlex.split(line.replace("[", " ").replace("]", " "))
        for flag, value in itertools.pairwise(args):
            checked += flag in ("--trace", "--only", "--variant")
            if flag == "--trace" and value not in (*TRACES, "all"):
                unknown.append(f"{where} trace {value}")
            if flag == "--only":
                for wanted in value.split("|"):
                    if not any(wanted[1:] == n if wanted.startswith("=") else wanted in n for n in names):
                        unknown.append(f"{where} setup {wanted}")
            if flag == "--variant" and value not in VARIANTS:
                unknown.append(f"{where} variant {value}")
    assert checked >= 5 and not unknown, unknown


def literal_number(node: ast.expr | None, known: dict[str, float | None]) -> float | None:
    """A module constant's value where it is a number or arithmetic on numbers and the module's earlier constants
    (``0.05``, ``64 * 1024 * 1024``, ``1 << 20``, ``3 * RENEW_S``), else None."""
    if isinstance(node, ast.Constant):
        value = node.value
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    if isinstance(node, ast.Name):
        return known.get(node.id)
    if isinstance(node, ast.BinOp):
        left, right = literal_number(node.left, known), literal_number(node.right, known)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.LShift):
            return float(int(left) << int(right))
        if isinstance(node.op, ast.Pow):
            return float(left**right)
    return None


def code_definitions() -> tuple[dict[str, set[str]], dict[str, float | None]]:
    """Every class of the repository's code with the attributes it defines (methods, class-level fields, and what its
    methods assign to self), and every module-level name with its value where that is a plain number; read with ast,
    nothing imported."""
    classes: dict[str, set[str]] = {}
    module_names: dict[str, float | None] = {}
    for top in ("gateway", "backends", "loadtests"):
        for path in (REPO / top).rglob("*.py"):
            tree = ast.parse(path.read_text())
            own: dict[str, float | None] = {}  # this module's constants so far, for one defined from another
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for target in targets:
                    if isinstance(target, ast.Name):
                        own[target.id] = literal_number(getattr(node, "value", None), own)
                        module_names[target.id] = own[target.id]
            for found in ast.walk(tree):
                if not isinstance(found, ast.ClassDef):
                    continue
                names = classes.setdefault(found.name, set())
                for inner in ast.walk(found):
                    if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(inner.name)
                    elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                        names.add(inner.id)
                    elif (
                        isinstance(inner, ast.Attribute)
                        and isinstance(inner.ctx, ast.Store)
                        and isinstance(inner.value, ast.Name)
                        and inner.value.id == "self"
                    ):
                        names.add(inner.attr)
    return classes, module_names


# Names in backticks that are not the repository's code: signals, socket options, environment variables, SQL-ish
# words the runbook quotes.
NOT_CODE_NAMES = {"SIGHUP", "SIGTERM", "SO_REUSEPORT", "LD_LIBRARY_PATH", "PATH", "LIBDIR", "FROM", "DELETE"}


def test_every_class_member_and_constant_the_docs_name_is_defined() -> None:
    """`Pool.lease`, `ReplicaHealth.full_weight_at`, `SHARE_S`: a renamed method, field or constant fails here
    instead of leaving the docs' map pointing at nothing, and a value the docs give a constant (`SHARE_S` (50 ms))
    is the code's. Libraries' classes the docs name (aiohttp's `Application._handle`, prometheus-client's
    `MutexValue.inc`) are looked up in the library."""
    from aiohttp import web
    from prometheus_client import values

    classes, module_names = code_definitions()
    for library_class in (web.Application, values.MutexValue):
        classes.setdefault(library_class.__name__, set()).update(dir(library_class))
    members = doc_matches(r"`([A-Z][A-Za-z0-9]+)\.([a-z_][a-z0-9_]*)(?:\(\))?`")
    # The value the docs give a constant: `SHARE_S` (50 ms), `FLYING_GRACE_S`, 0.1 s, `MAX_SHARED_PAIRS` (4,096).
    constants = doc_matches(
        r"`([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+|[A-Z]{4,})`"
        r"(?:(?: \(|, )(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?: ?(ms|s|MiB)\b)?(?![\d,.]*\d))?"
    )
    missing = [
        f"{where} {match.group(1)}.{match.group(2)}"
        for where, match in members
        if match.group(2) not in classes.get(match.group(1), set())
    ]
    known = module_names.keys() | NOT_CODE_NAMES
    missing += [
        f"{where} {match.group(1)}"
        for where, match in constants
        if match.group(1) not in known and not match.group(1).startswith(("TENANTGATE_", "VLLM_"))
    ]
    scale = {"ms": 1e-3, "s": 1.0, "MiB": 2**20, None: 1.0}
    valued = [(where, match) for where, match in constants if match.group(2) and match.group(1) in module_names]
    missing += [
        f"{where} {match.group(1)}: the docs say {match.group(2)} {match.group(3) or ''}, the code {value}"
        for where, match in valued
        if (value := module_names[match.group(1)]) is None
        or value != pytest.approx(float(match.group(2).replace(",", "")) * scale[match.group(3)])
    ]
    assert len(members) > 20 and len(constants) > 3 and len(valued) >= 3 and not missing, missing


def test_the_maps_name_every_driver_routing_and_runnable_loadtest_module() -> None:
    """README's "What is here" names each module of backends/ (in its row) and each loadtests module one runs
    (`python -m`); docs/architecture.md names each module of gateway/routing/. A new module off the map fails."""
    readme = (REPO / "README.md").read_text()
    backends_row = next(line for line in readme.splitlines() if line.startswith("| `backends/` |"))
    architecture = (REPO / "docs" / "architecture.md").read_text()
    missing = [
        f"README's backends/ row: {path.name}"
        for path in sorted((REPO / "backends").glob("*.py"))
        if path.name != "__init__.py" and f"`{path.name}`" not in backends_row
    ]
    missing += [
        f"docs/architecture.md: {path.relative_to(REPO)}"
        for path in sorted((REPO / "gateway" / "routing").rglob("*.py"))
        if path.name != "__init__.py" and f"{path.name}`" not in architecture
    ]
    runnable = [
        path for path in sorted((REPO / "loadtests").glob("*.py")) if 'if __name__ == "__main__"' in path.read_text()
    ]
    missing += [f"README: {path.name}" for path in runnable if f"`loadtests/{path.name}`" not in readme]
    assert len(runnable) > 10 and not missing, missing


def test_the_request_paths_map_names_modules_and_classes_that_exist() -> None:
    """docs/architecture.md, "One request's path": the diagram names modules without backticks and often without
    their package's `gateway/` or their `.py` (`tenants/identity.py`, `routing/pipeline`, `fleet/pool.Lease`);
    each is a module (or package) of the tree, and a class named after one is defined there."""
    text = (REPO / "docs" / "architecture.md").read_text()
    [diagram] = re.findall(r"```\n(client .*?)```", text, re.DOTALL)
    packages = "|".join(path.name for path in (REPO / "gateway").iterdir() if (path / "__init__.py").exists())
    named = list(
        re.finditer(
            rf"(?<![\w/])((?:gateway/)?(?:{packages})/[a-z_]+|backends/[a-z_]+|gateway/[a-z_]+)(?:\.py)?"
            r"(?:\.([A-Z]\w+))?",
            diagram,
        )
    )
    missing = []
    for match in named:
        path = match.group(1) if match.group(1).startswith(("gateway/", "backends/")) else "gateway/" + match.group(1)
        module = REPO / (path + ".py")
        if not module.exists() and not (REPO / path / "__init__.py").exists():
            missing.append(match.group(0))
        elif match.group(2) and not re.search(rf"^class {match.group(2)}\b", module.read_text(), re.MULTILINE):
            missing.append(f"{match.group(0)}: no class {match.group(2)}")
    assert len(named) >= 12 and not missing, missing


def test_every_test_the_docs_cite_exists() -> None:
    """A test file the docs name (`test_slot_signal_redis.py`, with or without its folder or backticks) and a test
    function they cite by name: a renamed or removed test fails here instead of leaving a claim without its proof."""
    files = {path.name for path in (REPO / "tests").rglob("test_*.py")}
    defined = {
        match.group(1)
        for path in (REPO / "tests").rglob("*.py")
        for match in re.finditer(r"^(?:async )?def (test_\w+)", path.read_text(), re.MULTILINE)
    }
    cited_files = doc_matches(r"\b(test_[a-z0-9_]+\.py)\b")
    cited_tests = doc_matches(r"(?:`|::)(test_[a-z0-9_]+)(?:`|\b)(?!\.py|\*)")
    missing = [f"{where} {match.group(1)}" for where, match in cited_files if match.group(1) not in files]
    missing += [f"{where} {match.group(1)}" for where, match in cited_tests if match.group(1) not in defined]
    assert len(cited_files) > 20 and len(cited_tests) >= 2 and not missing, missing


def test_nothing_in_the_repository_points_outside_it() -> None:
    """No tracked file names a path of the machine it was written on (under /work), the design notes kept beside
    the repository, or a package registry's host (the locks are written without index URLs): a fresh clone has
    none of the first two, so such a pointer leads nowhere, and where packages come from is the installer's
    configuration, not the repository's."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    registries = (
        r"\b(?:(?:files\.)?py"
        + r"pi\.org|python"
        + r"hosted\.org|registry\.npm"
        + r"js\.org|proxy\.go"
        + r"lang\.org|crates\.io)\b"
    )
    outside = re.compile(r"(?<![\w.-])/wor" + r"k/|\bDESIGN" + r"\.md\b|" + registries)  # split: this file names none
    found = []
    for name in tracked.stdout.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary file
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in outside.finditer(text)]
    assert len(tracked.stdout) > 1000 and not found, found


def test_every_config_key_is_named_in_the_docs() -> None:
    """Each field of the config (the engines' own sections aside: docs/triton.md's example) is named in some doc's
    code span: whole (`pools[].connect_timeout_s`), by its last part (`warm_ms`), or in a section's snippet
    (`health: {interval_s, timeout_s, ...}`). A new key fails here until an operator can read what it does."""
    spans = [span for path in DOCS for span in re.findall(r"`((?:[^`\n]|\n(?!\n))+)`", path.read_text())]
    words = {word for span in spans for word in re.findall(r"[a-z_]+", span)}
    keys: list[tuple[str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            section = nested_model(field.annotation)
            if section is None:
                keys.append((prefix + name, name))
            elif name != "settings":  # an engine's own section (`triton: {...}`)
                walk(section, f"{prefix}{name}{'[]' if typing.get_origin(field.annotation) is list else ''}.")

    walk(GatewayConfig, "")
    unnamed = [key for key, name in keys if key not in spans and name not in words]
    assert len(keys) > 150 and not unnamed, unnamed


def test_every_section_the_docs_point_to_by_name_exists() -> None:
    """(docs/benchmarks.md, "Three gateways: which view costs the tail"), (README, Caps cannot be dodged): the
    section named is a heading or a bold lead of that file, so a renamed or removed section fails here instead of
    leaving a claim's evidence unfindable."""
    # The title may begin on the next line ('docs/benchmarks.md,\n"Three gateways: ...'): a line break is a space.
    pointers = doc_matches(r"\b(README|docs/[a-z_-]+\.md),?\s+[\"“]([^\"”]+)[\"”]")
    pointers += doc_matches(r"\b(README|docs/[a-z_-]+\.md),\s+([A-Z][^)(;:,.\"“]*?)(?=[);:,.])")
    missing = []
    for where, match in pointers:
        text = (REPO / ("README.md" if match.group(1) == "README" else match.group(1))).read_text()
        titles = re.findall(r"^#+\s+(.*)$", text, re.MULTILINE) + re.findall(r"\*\*([^*]+)\*\*", text)
        named = " ".join(match.group(2).split()).lower()
        if not any(named in " ".join(title.split()).lower() for title in titles):
            missing.append(f"{where} {match.group(1)}, {match.group(2)}")
    assert len(pointers) >= 15 and not missing, missing


# snake_case names the docs quote that are other software's: OpenAI's content parts, TensorRT-LLM's and vLLM's
# settings and metrics, prometheus-client's family.
NOT_OUR_NAMES = {
    "image_url",
    "input_audio",
    "max_input_len",
    "lora_cache_gpu_memory_fraction",
    "lora_cache_host_memory_bytes",
    "enable_kv_cache_reuse",
    "lm_head",
    "tensorrt_llm",
    "lora_requests_info",
    "python_info",
}


def test_every_snake_case_name_the_docs_quote_is_the_codes() -> None:
    """`flying_at`, `remote_used`, `trim_over_bound()`, `cold_loads_by_cause`: a function, attribute, variable,
    module or string of gateway/, backends/ or loadtests/ (read with ast), a config key or a metric; a renamed one
    fails here instead of leaving the docs' map pointing at nothing."""
    names: set[str] = set()
    for top in ("gateway", "backends", "loadtests"):
        for path in (REPO / top).rglob("*.py"):
            names.add(path.stem)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)
    known = names | leaf_fields().keys() | NOT_OUR_NAMES
    quoted = doc_matches(r"`([a-z][a-z0-9]*_[a-z0-9_]+)(?:\(\))?`")
    unknown = [f"{where} {match.group(1)}" for where, match in quoted if match.group(1) not in known]
    # Metrics and tests have checks of their own above.
    unknown = [entry for entry in unknown if " tenantgate_" not in entry and " test_" not in entry]
    assert len(quoted) > 200 and not unknown, unknown


def bench_overhead_rows(table: str) -> dict[str, list[float]]:
    """A make bench-overhead table's cells 'a / b / c' at 64 clients, by setup and column (req/s, CPU per request)."""
    cells: dict[str, list[float]] = {}
    for row in table.splitlines()[2:]:
        setup, clients, rate, _, cpu = (cell.strip() for cell in row.strip("|").split("|"))
        if clients != "64":
            continue
        for column, text in (("req/s", rate), ("cpu", cpu)):
            values = [float(v.replace(",", "")) for v in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]
            if values:
                cells[f"{setup} {column}"] = values
    return cells


def test_the_readmes_bench_overhead_figures_are_the_latest_runs_in_the_benchmarks() -> None:
    """README's `loadtests/bench_overhead.py` row quotes the newest make bench-overhead table of docs/benchmarks.md:
    the default's CPU per request and req/s, vllm-router's, the bare aiohttp proxy's CPU, the default against that
    floor, and how many runs; a new table without the README following (or a slip in the ranges) fails here."""
    header = "| setup | clients | req/s | added p50 ms | CPU per request |"
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    table = benchmarks[benchmarks.rindex(header) :].split("\n\n")[0]
    cells = bench_overhead_rows(table)
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `loadtests/bench_overhead.py` |"))
    quoted = re.search(
        r"costs (\d+)-(\d+) us of CPU per request at ([\d,]+)-([\d,]+) req/s, against vllm-router's (\d+)-(\d+) us"
        r" and ([\d,]+)-([\d,]+) req/s and the bare aiohttp proxy's (\d+)-(\d+) us \(([\d.]+)-([\d.]+)x that floor\),"
        r" in the same (\w+) runs",
        row,
    )
    assert quoted is not None, "README's bench_overhead row no longer reads as this test expects: update both"
    default, floor = cells["tenantgate (default) cpu"], cells["bare aiohttp proxy cpu"]
    ratios = [round(d / f, 2) for d, f in zip(default, floor, strict=True)]
    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}

    def span(values: list[float], form: str = "{:,.0f}") -> tuple[str, str]:
        return form.format(min(values)), form.format(max(values))

    expected = (
        *span(default),
        *span(cells["tenantgate (default) req/s"]),
        *span(cells["vllm-router cpu"]),
        *span(cells["vllm-router req/s"]),
        *span(floor),
        *span(ratios, "{:.2f}"),
        words.get(len(default), str(len(default))),
    )
    assert quoted.groups() == expected
    # The realistic load the row describes is the benchmark's.
    from loadtests.bench_overhead import REPLICAS, TENANTS

    assert f"({len(TENANTS)} tenants over {REPLICAS} replicas, 64 clients, access log on)" in row
    assert TelemetryConfig().access_log  # the default config's, which the row's setup runs
    # The machine's load while those runs were measured, as the section that holds the table gives it.
    section = benchmarks[benchmarks.rindex("\n#", 0, benchmarks.rindex(header)) :].split(header)[0]
    load = re.search(r"runs on a machine at load ([\d.]+-[\d.]+)", row)
    assert load is not None and re.search(rf"load average (?:at )?{re.escape(load.group(1))}\b", section), row
    workers = cells["tenantgate `--workers 2` req/s"]
    against = [round(w / v, 2) for w, v in zip(workers, cells["vllm-router req/s"], strict=True)]
    assert "`--workers 2` reached {}-{}x vllm-router's req/s".format(*span(against, "{:.2f}")) in row


def test_every_overhead_setup_the_docs_name_is_one_the_benchmarks_run() -> None:
    """`bare-fast`, `tenantgate-nolog`, `--only bare-http1,bare-fast`: an --only naming a setup bench_overhead does
    not have runs nothing but `direct` without a word, so a renamed setup would leave the docs' commands measuring
    nothing. Each such name the docs give is one of bench_overhead's or bench_instructions' setups, and the docs'
    table of bench_instructions' counts has a row for each of its setups."""
    from loadtests.bench_instructions import SETUPS as INSTRUCTION_SETUPS

    overhead_source = (REPO / "loadtests" / "bench_overhead.py").read_text()
    overhead = set(re.findall(r'^\s+\("([a-z0-9-]+)", lambda', overhead_source, re.MULTILINE))
    known = overhead | set(INSTRUCTION_SETUPS) | {"vllm-router", "sglang-router"}
    # The benchmarks' pages only: docs/operations.md's `tenantgate-redis` is a Kubernetes object.
    named = [
        (where, match)
        for where, match in doc_matches(r"`((?:bare|tenantgate)-[a-z0-9]+)`")
        if where.startswith(("README.md", "docs/benchmarks.md"))
    ]
    only = doc_matches(r"--only ((?:bare|tenantgate|direct|vllm|sglang)[a-z0-9,-]*)")
    unknown = [f"{where} {match.group(1)}" for where, match in named if match.group(1) not in known]
    unknown += [
        f"{where} --only {name}" for where, match in only for name in match.group(1).split(",") if name not in known
    ]
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    section = benchmarks[benchmarks.index("`python -m loadtests.bench_instructions` measures") :]
    rows = re.findall(r"^\| `([a-z0-9-]+)`", section[: section.index("\n\n", section.index("| setup |"))], re.MULTILINE)
    unknown += [
        f"docs/benchmarks.md: no row for bench_instructions' {name}" for name in INSTRUCTION_SETUPS if name not in rows
    ]
    assert {"tenantgate-w2", "bare-fast"} <= overhead and len(named) >= 5 and len(only) >= 2 and not unknown, unknown


def spread(cell: str) -> tuple[float, float, float]:
    """A table cell's 'mean (lowest-highest)': '24 (17-34)', '3,404 ms (2,797-3,945)'."""
    found = re.match(r"([\d,.]+)(?: ms)? \(([\d,.]+)-([\d,.]+)\)", cell)
    assert found is not None, cell
    mean, low, high = (float(group.replace(",", "")) for group in found.groups())
    return mean, low, high


def test_the_readmes_slot_budget_figures_are_the_benchmarks_tables() -> None:
    """README, Homes from traffic: the noisy tenant's cost to its quiet neighbours before and after, collide's and
    hot's TTFT p99 with copies within the slot budget against before, and collide's cold loads against balanced
    homes are what docs/benchmarks.md's "Copies within the slot budget" tables say (a range: lowest to highest run),
    and so are the figures that section's own reading quotes from its collide and hot table."""
    from loadtests.noisy_tenant import NOISY, TENANTS

    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    section = benchmarks[benchmarks.index("### Copies within the slot budget") :]
    section = section[: section.index("\n### ")]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith(("| setup ", "| trace ")):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            key_cells = 1 if cells[0].startswith(("main", "this code")) else 2  # the noisy table's, or collide's
            rows[", ".join(cells[:key_cells])] = cells[key_cells:]
    readme = " ".join((REPO / "README.md").read_text().split())
    before, after = spread(rows["main, traffic homes"][0]), spread(rows["this code, traffic homes"][0])
    quiet = len([t for t in TENANTS if t != NOISY])
    noisy = f"cost its {quiet} quiet neighbours {before[1]:.0f}-{before[2]:.0f} cold loads in 20 s before, "
    assert noisy + f"{after[1]:.0f}-{after[2]:.0f} after" in readme
    p99_now = [spread(rows[f"{trace}, traffic homes, this code, v2"][1]) for trace in ("collide", "hot")]
    p99_before = [spread(rows[f"{trace}, traffic homes, main"][1]) for trace in ("collide", "hot")]

    def seconds(figures: list[tuple[float, float, float]]) -> str:
        return f"{min(f[1] for f in figures) / 1000:.1f}-{max(f[2] for f in figures) / 1000:.1f} s"

    assert f"collide and hot TTFT p99 {seconds(p99_now)} against {seconds(p99_before)} before" in readme
    cold, balanced = rows["collide, traffic homes, this code, v2"][0], rows["collide, balanced homes"][0]
    assert f"collide's cold loads are {cold} against balanced homes' {balanced}" in readme
    assert f"queue there (TTFT p99 {p99_now[0][0] / 1000:.1f} s)" in readme
    # The section's own reading of its collide and hot table.
    prose = " ".join(section.split())
    peaks = {key: spread(cells[3]) for key, cells in rows.items() if key.startswith(("collide, ", "hot, "))}
    new_peaks = [peaks[f"{trace}, traffic homes, this code, v2"] for trace in ("collide", "hot")]
    old_peaks = [figures for key, figures in peaks.items() if "this code" not in key]
    assert (
        f"(peak queue {new_peaks[0][1]:.0f}-{new_peaks[0][2]:.0f} on collide, {new_peaks[1][1]:.0f}-"
        f"{new_peaks[1][2]:.0f} on hot, against {min(f[1] for f in old_peaks):.0f}-{max(f[2] for f in old_peaks):.0f})"
    ) in prose
    main_cold = spread(rows["collide, traffic homes, main"][0])[0]
    cold_loads = f"{spread(cold)[0]:.0f} against {spread(balanced)[0]:.0f}, {main_cold:.0f} on main's traffic homes"
    assert f"({cold_loads})" in prose
    assert f"spills past the bound go cold: {rows['hot, traffic homes, this code, v2'][4]} streams" in prose


def trace_rows(heading: str, key_cells: int) -> tuple[str, dict[str, list[str]]]:
    """docs/benchmarks.md's section under ``heading`` (to the next ``###``), and its table's collide and hot rows: the
    rest of each row's cells by its first ``key_cells`` cells, joined with ", "."""
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    section = benchmarks[benchmarks.index(heading) :]
    section = section[: section.index("\n### ")]
    rows = {}
    for line in section.splitlines():
        if line.startswith(("| collide ", "| hot ")):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[", ".join(cells[:key_cells])] = cells[key_cells:]
    return section, rows


def test_the_readmes_seat_sizing_figures_are_the_benchmarks_table() -> None:
    """README, Homes from traffic: hot's and collide's figures with a heavy key sized by seats are what
    docs/benchmarks.md's "Sized by seats" table says."""
    _, rows = trace_rows("### Sized by seats", 2)
    readme = " ".join((REPO / "README.md").read_text().split())
    hot_now, hot_main = rows["hot, traffic homes, this code"][1], rows["hot, traffic homes, main"][1]
    hot_balanced = rows["hot, balanced homes, this code"][1]
    assert f"hot's TTFT p99 with traffic homes is {hot_now} against {hot_main} on main" in readme
    assert f"and {hot_balanced} with balanced homes" in readme
    collide, balanced = rows["collide, traffic homes, this code"], rows["collide, balanced homes, this code"]
    assert f"collide's TTFT p99 with traffic homes is {collide[1]} against balanced homes' {balanced[1]}" in readme
    assert f"its cold loads {collide[0]} against {balanced[0]}" in readme
    light, light_balanced = collide[3].split(" (")[0], balanced[3].split(" (")[0]
    assert f"light tenants' p99 {light} against {light_balanced}" in readme


def test_the_readmes_confinement_exit_figures_are_the_benchmarks_table() -> None:
    """README, Homes from traffic: collide's and hot's figures with confinement given an exit and a measured first
    table are what docs/benchmarks.md's "Collide: why traffic homes queued" table says."""
    _, rows = trace_rows("### Collide: why traffic homes queued", 3)
    readme = " ".join((REPO / "README.md").read_text().split())
    collide = rows["collide, exit + window, traffic homes"]
    balanced = rows["collide, exit + window, balanced homes"]
    assert f"collide's TTFT p99 with traffic homes is {collide[1]} against balanced homes' {balanced[1]}" in readme
    assert f"its cold loads {collide[0]} against {balanced[0]}" in readme
    hot, hot_balanced = rows["hot, exit + window, traffic homes"], rows["hot, exit + window, balanced homes"]
    assert f"hot's TTFT p99 {hot[1]} against {hot_balanced[1]}" in readme


def test_the_readmes_json_containers_figures_are_the_benchmarks_table() -> None:
    """README, Inputs are canonical: the refusal's figures for the body of many arrays are docs/benchmarks.md's table
    from loadtests/bench_json_containers.py, and the figures from before the limit are said to be measured once."""
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    section = benchmarks[benchmarks.index("## A body of many arrays") :]
    row = next(line for line in section.splitlines() if line.startswith("| refused by its bytes"))
    low, median, high = (cell.strip() for cell in row.strip("|").split("|")[1:4])
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "held the event loop 0.35-1 s at load 2-7, every tenant's requests behind it, measured once" in readme
    assert f"now it is refused in {low}-{high} ms, median {median}" in readme
    assert "0.35-1 s" in section


def test_the_readmes_counted_when_placed_figures_are_the_benchmarks_table() -> None:
    """README, Homes from traffic: collide's figures with requests counted when placed (and the rest of that
    section's changes) are what docs/benchmarks.md's "Collide and hot: traffic counted when placed" table says, and so
    is the hot tenant's cold-stream range the section's reading quotes."""
    section, rows = trace_rows("### Collide and hot: traffic counted when placed", 3)
    readme = " ".join((REPO / "README.md").read_text().split())

    traffic, balanced = rows["collide, this code, traffic homes"], rows["collide, this code, balanced homes"]
    assert f"collide's cold loads with traffic homes are {traffic[0]} against balanced homes' {balanced[0]}" in readme
    assert f"its TTFT p99 {traffic[1]} against {balanced[1]}" in readme
    reading = " ".join(section.split())
    assert "traffic homes 11, 19 and 26 against balanced homes' 0, 7 and 7" in reading
    assert "cold streams after its second home is warm 11-26 against 0-7" in readme


def test_the_heap_reserve_the_docs_state_is_the_one_start_up_makes() -> None:
    """README and docs/benchmarks.md say the gateway touches 16 MiB of its heap at start-up (gateway/fleet/heap.py):
    that is the reserve's size, and the server and the decision benchmark both make it."""
    from gateway.fleet import heap

    mib = heap.RESERVE_BYTES // (1024 * 1024)
    readme = " ".join((REPO / "README.md").read_text().split())
    benchmarks = " ".join((REPO / "docs" / "benchmarks.md").read_text().split())
    assert f"touches {mib} MiB of its small-object heap once at start-up" in readme
    assert f"{mib} MiB of the small-object heap touched once" in benchmarks
    for source in ("gateway/server.py", "loadtests/bench_decision.py"):
        assert "heap.reserve()" in (REPO / source).read_text(), source
    # Each worker is a `tenantgate serve` process of its own (gateway/workers.py starts them), whose start-up makes
    # the reserve: operations.md's --workers section counts it per worker, and the supervisor makes none.
    operations = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert f"N workers start N x {mib} MiB more resident than N bare processes, the supervisor none" in operations
    assert "heap" not in (REPO / "gateway" / "workers.py").read_text()
