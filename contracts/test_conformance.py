"""The kit's own test module, for authors who write no test file::

    pytest --pyargs offload_ref.contracts -m contract --offload-ref-spec my_package.testing:SPEC

``--offload-ref-spec`` (repeatable) names a ``PipelineSpec``, a list of them, or a factory, as
``offload-ref check`` takes it; the plugin generates one test per (check, pipeline, strategy).
Without ``--offload-ref-spec`` collecting this module is a usage error that says so.
``--offload-ref-offloader my_engine.offload:factory`` judges another offloader than offload-ref's
backends (docs/model-authors.md, section 9).
"""


def test_offload_ref(offload_ref_check):
    offload_ref_check()
