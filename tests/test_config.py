"""`parley serve`'s configuration (service/config.py): flags and PARLEY_* variables from one declaration, a flag
winning over its variable, bad values refused as argparse refuses them, and the README's flag table kept true."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import parse
from service.config import ServeConfig

ROOT = Path(__file__).resolve().parent.parent


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def variable(field: str) -> str:
    return "PARLEY_" + field.upper()


@pytest.fixture(autouse=True)
def no_parley_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PARLEY_")]:
        monkeypatch.delenv(name)


def test_defaults_variables_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(["serve"]) == ServeConfig()
    monkeypatch.setenv("PARLEY_MAX_BATCH", "16")
    monkeypatch.setenv("PARLEY_SLA_MS", "250")
    monkeypatch.setenv("PARLEY_STRICT_SLA", "true")
    monkeypatch.setenv("PARLEY_DEVICE", "cpu")
    cfg = parse(["serve", "--sla-ms", "80", "--no-strict-sla", "--backend", "reference", "--access-log"])
    assert (cfg.max_batch, cfg.device) == (16, "cpu")  # the variables
    assert (cfg.sla_ms, cfg.strict_sla, cfg.backend, cfg.access_log) == (80.0, False, "reference", True)  # flags win
    monkeypatch.setenv("PARLEY_STRICT_SLA", "0")
    assert parse(["serve", "--strict-sla"]).strict_sla is True


@pytest.mark.parametrize("argv,env,named", [
    (["serve", "--port", "eighty"], {}, "--port (PARLEY_PORT)"),
    (["serve", "--backend", "tpu"], {}, "--backend (PARLEY_BACKEND)"),
    (["serve"], {"PARLEY_MAX_CONTEXT": "lots"}, "--max-context (PARLEY_MAX_CONTEXT)"),
    (["serve", "--max-bach", "4"], {}, "unrecognized arguments: --max-bach"),
    (["serve", "--max-batch", "8", "--max-rows", "4"], {}, "--max-rows (PARLEY_MAX_ROWS)"),
    (["serve", "--calibration-budget-s", "0"], {}, "--calibration-budget-s (PARLEY_CALIBRATION_BUDGET_S)"),
])
def test_bad_values_exit_2_naming_the_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch, capsys, argv, env,
                                                            named) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_calibration_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The start-up calibration's cache: a directory, `off`, or unset (the user's cache directory); its budget."""
    from service.calibration import cache_dir_of

    cfg = parse(["serve"])
    assert cfg.calibration_cache is None and cfg.calibration_budget_s is None and cfg.max_rows is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir_of(cfg.calibration_cache) == tmp_path / "parley" / "calibration"
    monkeypatch.setenv("PARLEY_CALIBRATION_CACHE", "off")
    assert cache_dir_of(parse(["serve"]).calibration_cache) is None
    cfg = parse(["serve", "--calibration-cache", str(tmp_path / "c"), "--calibration-budget-s", "1.5",
                 "--max-rows", "32"])
    assert (cache_dir_of(cfg.calibration_cache), cfg.calibration_budget_s, cfg.max_rows) == (tmp_path / "c", 1.5, 32)


def test_help_lists_every_flag_with_its_variable_and_the_backends(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["serve", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in ServeConfig.model_fields:
        assert flag(name) in out and variable(name) in out, name
    assert "--no-strict-sla" in out
    from service.backends import BACKENDS

    assert "{" + ",".join(BACKENDS) + "}" in out


def test_parley_help_does_not_load_torch() -> None:
    probe = ("import sys\nfrom service.cli import parse\ntry:\n    parse(['serve', '--help'])\n"
             "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'parley --help imported torch'\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]


# -- the README's table ---------------------------------------------------------------------------------------
def readme_flag_rows() -> list[tuple[list[str], list[str]]]:
    """The `parley serve` table of the README: each row's flags and its default cell's parts."""
    section = (ROOT / "README.md").read_text().split("## `parley serve`", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`--"):
            rows.append((re.findall(r"`(--[a-z0-9-]+)`", cells[0]), [p.strip() for p in cells[1].split(",")]))
    return rows


def shown(default: object) -> str | None:
    """A default as the README writes it (None: the README says it in words)."""
    if default is None:
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def test_the_readme_flag_table_is_true() -> None:
    rows = readme_flag_rows()
    assert rows, "the README's `parley serve` table was not found"
    fields = ServeConfig.model_fields
    in_table = [f for flags, _ in rows for f in flags]
    assert sorted(in_table) == sorted(flag(n) for n in fields), "every field of ServeConfig once in the table"
    for flags, defaults in rows:
        assert len(defaults) in (1, len(flags)), (flags, defaults)  # one default each, or one for all
        for i, f in enumerate(flags):
            want = shown(fields[f[2:].replace("-", "_")].default)
            if want is not None:
                assert defaults[i if len(defaults) > 1 else 0].strip("`") == want, (f, defaults)


def test_the_engine_runs_in_its_own_process_on_a_gpu_unless_told() -> None:
    """Unset, the engine runs in a process of its own where the device is a GPU and as a thread on the CPU (one
    process is all a CPU server needs); --engine-process and --no-engine-process decide either way."""
    from service.config import engine_in_own_process

    assert parse(["serve"]).engine_process is None
    assert engine_in_own_process(parse(["serve", "--device", "cuda"]))
    assert engine_in_own_process(parse(["serve", "--device", "cuda:1"]))
    assert not engine_in_own_process(parse(["serve", "--device", "cpu"]))
    assert not engine_in_own_process(parse(["serve", "--device", "cuda", "--no-engine-process"]))
    assert engine_in_own_process(parse(["serve", "--device", "cpu", "--engine-process"]))
