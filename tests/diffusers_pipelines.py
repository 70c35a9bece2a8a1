"""The real diffusers pipeline the tests use lives in the package (``offload_ref.fixtures.diffusers_dit``)
so that ``offload-ref peers`` can judge offloaders on it from a clean install; re-exported here."""

from offload_ref.fixtures.diffusers_dit import (  # noqa: F401
    DIT_SPEC,
    DeclaredDiTPipeline,
    build_dit,
    dit_inputs,
)
