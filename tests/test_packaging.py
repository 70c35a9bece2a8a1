"""The installed package, seen from outside the repository.

Under test: the public names import; the kit and the fixtures live under ``offload_ref.`` only
(no top-level ``contracts`` / ``fixtures`` of ours); the pytest11 plugin loads without torch; the
13 fixture specs build; the ``offload-ref`` console script runs (without torch's NumPy
warning: numpy is a declared dependency); and a downstream author's test
file using ``OFFLOAD_REF_SPECS`` + ``offload_ref_check`` runs under pytest.

Every subprocess runs with ``cwd=tmp_path`` and without ``PYTHONPATH``, so only what is installed
is importable.  There are few of them: each costs about two seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_TIMEOUT_S = 120

_IMPORTS_SCRIPT = textwrap.dedent("""
    import importlib, json, os, sys

    repo = os.path.realpath(sys.argv[1])
    report = {"sys_path_has_repo": any(
        os.path.realpath(p or os.getcwd()) == repo for p in sys.path)}

    import offload_ref.contracts
    import offload_ref.fixtures
    import offload_ref.contracts.plugin
    from offload_ref import (OffloadConfig, OffloadStrategy, OffloadPlan,
                             SupportsComponentDiscovery, resolve_offload_plan,
                             get_offload_backend, HookRegistry, ModelHook)
    from offload_ref.platform import get_platform
    report["public"] = [o.__name__ for o in (
        OffloadConfig, OffloadStrategy, OffloadPlan, SupportsComponentDiscovery,
        resolve_offload_plan, get_offload_backend, HookRegistry, ModelHook, get_platform)]
    report["kit_files"] = {name: os.path.realpath(sys.modules[name].__file__)
                           for name in ("offload_ref.contracts", "offload_ref.fixtures")}

    # Top-level "contracts" / "fixtures": absent, or somebody else's package.
    report["top_level"] = {}
    for name in ("contracts", "fixtures"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            report["top_level"][name] = None
        else:
            report["top_level"][name] = os.path.realpath(
                getattr(module, "__file__", None) or next(iter(module.__path__)))

    import torch
    from offload_ref.fixtures import SPECS
    built = {}
    for spec in SPECS:
        pipeline = spec.build()
        inputs = spec.make_inputs()
        built[spec.name] = [isinstance(pipeline, torch.nn.Module), type(inputs).__name__,
                            sum(p.numel() for p in pipeline.parameters())]
    report["specs"] = built
    print("REPORT" + json.dumps(report))
""")

_PLUGIN_ONLY_SCRIPT = textwrap.dedent("""
    import json, sys
    import offload_ref.contracts.plugin
    heavy = sorted(m for m in ("torch", "numpy", "hypothesis", "safetensors") if m in sys.modules)
    print("REPORT" + json.dumps(heavy))
""")

_DOWNSTREAM_TEST = textwrap.dedent("""
    from offload_ref.fixtures import get_spec

    OFFLOAD_REF_SPECS = [get_spec("nextstep")]
    OFFLOAD_REF_EXPECTED_FAILURES = {}


    def test_offload(offload_ref_check):
        offload_ref_check()
""")


def _clean_env() -> dict[str, str]:
    """The environment of a user shell: nothing that points Python or pytest at the repo."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTEST_ADDOPTS", "PYTEST_PLUGINS",
                        "PYTHONSTARTUP", "PYTHONSAFEPATH")
           and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=False, cwd=cwd, env=_clean_env(), capture_output=True,
                          text=True, timeout=_TIMEOUT_S)


def _report(proc: subprocess.CompletedProcess, what: str):
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT")]
    assert lines, f"{what} printed no report:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("REPORT"):])


def _is_ours(path: str | None, folder: str) -> bool:
    if path is None:
        return False
    ours = (REPO / folder).resolve()
    return Path(path).resolve() == ours or ours in Path(path).resolve().parents


def test_public_names_and_kit_import_outside_the_repository(tmp_path: Path) -> None:
    report = _report(_run([sys.executable, "-c", _IMPORTS_SCRIPT, str(REPO)], tmp_path),
                     "the import script")
    assert not report["sys_path_has_repo"], "the repository root is on sys.path of the subprocess"
    assert report["public"] == [
        "OffloadConfig", "OffloadStrategy", "OffloadPlan", "SupportsComponentDiscovery",
        "resolve_offload_plan", "get_offload_backend", "HookRegistry", "ModelHook",
        "get_platform"], report["public"]
    for name, path in report["kit_files"].items():
        assert Path(path).name == "__init__.py", f"{name} resolved to {path}"
    for name, path in report["top_level"].items():
        assert not _is_ours(path, name), (
            f"a top-level module {name!r} is importable from this project ({path}); it must be "
            f"installed only as offload_ref.{name}")
    specs = report["specs"]
    assert len(specs) == 13, sorted(specs)
    bad = {name: v for name, v in specs.items() if not (v[0] and v[1] == "dict" and v[2] > 0)}
    assert not bad, f"fixture specs whose factory does not build a module with inputs: {bad}"


def test_plugin_module_does_not_import_torch(tmp_path: Path) -> None:
    heavy = _report(_run([sys.executable, "-c", _PLUGIN_ONLY_SCRIPT], tmp_path),
                    "importing offload_ref.contracts.plugin")
    assert heavy == [], f"importing the pytest11 plugin imported {heavy}"


def test_pytest11_entry_point_is_registered() -> None:
    found = [ep for ep in entry_points(group="pytest11") if ep.name == "offload_ref"]
    assert [ep.value for ep in found] == ["offload_ref.contracts.plugin"], found


def test_console_script_lists_checks(tmp_path: Path) -> None:
    exe = shutil.which("offload-ref")
    assert exe is not None, "the offload-ref console script is not on PATH"
    proc = _run([exe, "check", "--list"], tmp_path)
    assert proc.returncode == 0, f"offload-ref check --list exited {proc.returncode}:\n{proc.stderr}"
    ids = re.findall(r"\bcheck_[a-z0-9_]+\b", proc.stdout)
    assert len(ids) >= 10, f"offload-ref check --list printed {len(ids)} check ids:\n{proc.stdout}"
    assert "check_plan_resolution_is_pure" in ids
    # The command imports torch (the bench parser): with numpy missing, torch warns here.
    assert "NumPy" not in proc.stderr, proc.stderr


def test_numpy_is_a_declared_dependency_pinned_in_ci() -> None:
    """torch imports numpy when it is there and warns "Failed to initialize NumPy" on every
    import when it is not; torch's wheels do not depend on it, so the package must (issue 11).

    This venv has numpy, so the stderr assertion above cannot fail here: this one reads what
    ``pip install -c ci/constraints.txt -e .`` installs (README.md's first command)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = {Requirement(d).name: Requirement(d) for d in project["dependencies"]}
    assert "numpy" in deps, f"numpy is not in [project] dependencies: {sorted(deps)}"
    assert deps["numpy"].specifier, "numpy needs a version range"
    pins = {Requirement(line).name: Requirement(line) for line in
            (REPO / "ci" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")}
    assert "numpy" in pins, "ci/constraints.txt does not pin numpy"
    pinned = next(iter(pins["numpy"].specifier)).version
    assert deps["numpy"].specifier.contains(pinned), (pinned, str(deps["numpy"].specifier))


def test_downstream_author_test_file_runs_the_kit(tmp_path: Path) -> None:
    test_file = tmp_path / "test_my_pipeline.py"
    test_file.write_text(_DOWNSTREAM_TEST)
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file.name,
                 "-k", "plan_resolution", "-m", "contract"], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"pytest on a downstream test file exited {proc.returncode}:\n{output}"
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) > 0, f"no contract test ran:\n{output}"
    assert not re.search(r"[1-9]\d* (failed|error)", output), output

