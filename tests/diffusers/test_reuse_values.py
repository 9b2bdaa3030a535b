

@pytest.mark.parametrize("name", ["main_global_dict", "main_closure_tensor", "main_environment"])
def test_a_value_read_under_a_wrapper_from_another_package_is_still_read(name, qwen_pipe, images, setup):
    """The `__main__` patch wrapped again by a package the walk did not follow (the test's own `class_forward`):
    the wrapper was recorded by identity only, so what the patch under it reads was never read (a stale hit
    found by the property run). A function installed into the model's classes is a patch: its package is
    followed."""
    from changes import class_forward

    setup(name, qwen_pipe)
    wrapped = class_forward(qwen_pipe)
    try:
        reference = _changed(qwen_pipe, images[:1], VALUE_CHANGES[name])
        session = enable_kv_offload(qwen_pipe, "ram_sync", reuse_budget=BIG, reuse="always")
        _run(qwen_pipe, images[:1], seed=0)
        undo = VALUE_CHANGES[name](qwen_pipe)
        try:
            out = _run(qwen_pipe, images[:1])
        finally:
            undo()
        assert session.reuse.stats()["hits"] == 0 and np.array_equal(out, reference)
        disable_kv_offload(qwen_pipe)
    finally:
        wrapped()
