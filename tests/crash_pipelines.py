"""The author package of the crash and exit tests (test_crash_isolation.py,
test_escaping_exceptions.py), and the way they run the console script.

``crashy.pipes``: FLUX.2-shaped pipelines that are reproducible as a reference and, once
offloaded, end their own process (SIGSEGV, with or without the simulated accelerator's crash
line), raise a ``BaseException``, or sleep until the test presses Ctrl-C; and factories that
raise ``SystemExit`` or ``KeyboardInterrupt``.  ``crashy.exits_on_import`` exits while imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TIMEOUT_S = 180
BITWISE = "check_offloaded_output_matches_reference_bitwise"
REPEATABLE = "check_plan_resolution_is_repeatable"
#: what the simulated accelerator's crash handler writes (OFFLOAD_REF_SIM_CRASH_FILE)
OP_LINE = ("offload-ref simulated accelerator: fatal signal 11 (SIGSEGV) while running "
           "aten::fake_op.Tensor on hpu")

CRASHY = textwrap.dedent(f'''
    """Pipelines that end their own process, or raise a BaseException, once offloaded."""
    import os
    import signal
    import time

    from offload_ref.contracts import PipelineSpec
    from offload_ref.fixtures import flux2


    class Ends(flux2.Flux2Pipeline):
        how = "nothing"

        def forward(self, **inputs):
            backend = self.__dict__.get("_offload_ref_backend")
            if backend is not None:
                end(self.how, repr(backend))  # the owning backend's class name
            return super().forward(**inputs)


    def end(how, backend):
        if how == "op_crash":  # what the simulated accelerator's crash handler writes
            with open(os.environ["OFFLOAD_REF_SIM_CRASH_FILE"], "a") as f:
                f.write({OP_LINE!r} + "\\n")
        if how in ("segv", "op_crash"):
            os.kill(os.getpid(), signal.SIGSEGV)
        elif how == "system_exit":
            raise SystemExit(3)
        elif how == "interrupt":
            raise KeyboardInterrupt
        elif how == "generator_exit":
            raise GeneratorExit
        elif how == "sleep" and "LayerWise" in backend:
            open(os.environ["CRASHY_READY"], "w").close()
            time.sleep(120)


    def _factory(how):
        def factory(seed=0):
            pipeline = flux2.build(Ends, seed)
            pipeline.how = how
            return pipeline
        return factory


    def make_inputs(seed=0):
        return flux2.make_inputs(seed)


    def spec(how, strategies=("model_level",)):
        return PipelineSpec(name=how, factory=f"crashy.pipes:build_{{how}}",
                            inputs="crashy.pipes:make_inputs", strategies=strategies)


    for _how in ("nothing", "segv", "op_crash", "system_exit", "interrupt",
                 "generator_exit", "sleep"):
        globals()[f"build_{{_how}}"] = _factory(_how)

    GOOD = spec("nothing")
    CRASHING = [spec("segv"), spec("op_crash"), GOOD]
    SLEEP = spec("sleep", ("model_level", "layer_wise"))
    RAISING_IN_GENERATION = [spec("system_exit"), spec("interrupt"), spec("generator_exit")]


    def raise_system_exit_0(seed=0):
        raise SystemExit(0)


    def raise_system_exit_3(seed=0):
        raise SystemExit(3)


    def raise_interrupt(seed=0):
        raise KeyboardInterrupt
''')



def write_author(root: Path) -> Path:
    package = root / "crashy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pipes.py").write_text(CRASHY)
    (package / "exits_on_import.py").write_text("raise SystemExit(0)\n")
    return root


def env(root: Path) -> dict[str, str]:
    """The environment of a console script run from ``root`` (the author package on the path)."""
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    out["PYTHONPATH"] = str(root)
    out["PYTHONDONTWRITEBYTECODE"] = "1"
    return out


def cli(args: list[str], root: Path) -> subprocess.CompletedProcess:
    """``offload-ref check ARGS``, the console script, run from ``root``."""
    script = Path(sys.executable).with_name("offload-ref")
    return subprocess.run([str(script), "check", *args], check=False, cwd=root, env=env(root),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def results(path: Path) -> dict[str, dict]:
    """The results of a ``--json`` report, by case id."""
    report = json.loads(path.read_text())
    return {"-".join(p for p in (r["check"], r["pipeline"], r["strategy"]) if p): r
            for r in report["results"]}
