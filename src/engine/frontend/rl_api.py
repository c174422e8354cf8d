"""The RL-trainer methods of `LLM` and `AsyncLLM`: pause / resume, weight updates, weight
versions and `collective_rpc`.

Mixins over each class's utility call (`LLMEngine.call_utility` for `LLM`; every engine core
through `AsyncLLM.call_utility`, which returns once every core has answered: a pause, an update
or a resume is complete only when every data-parallel rank has done it). The four weight-update
methods have the names and arguments of vLLM's, so an `LLM` or `AsyncLLM` can be handed to
`ringserve.weight_transfer.TrainerWeightTransferEngine` as its sync client directly (the
trainer and the engine in one process); the HTTP routes (`ringserve.http.admin`) call the
`AsyncLLM` ones. What each does in the core: `ringserve.engine.core.weight_sync`.

Pause modes (`pause(mode=...)`; vLLM's default, "abort"):
- "abort": every request in flight ends now with finish reason "abort";
- "keep": requests stay where they are and continue after `resume()` (their KV is recomputed
  if the weights changed meanwhile);
- "wait": nothing new is scheduled; the call returns once the requests in flight have
  finished (AsyncLLM; `LLM` has none in flight between its calls).
Requests that arrive while paused are held and start on `resume()`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from ringserve.config import EngineConfig

if TYPE_CHECKING:
    from ringserve.engine.frontend.llm_engine import LLMEngine

PAUSE_MODES = ("abort", "keep", "wait")


def world_size(config: EngineConfig, include_dp: bool) -> int:
    """TP x DP workers (TP alone without `include_dp`)."""
    parallel = config.parallel_config
    tp = parallel.tensor_parallel_size
    return tp * parallel.data_parallel_size if include_dp else tp


def check_pause_mode(mode: object) -> str:
    """`mode` if it is a pause mode.

    Raises:
        ValueError: naming the allowed modes.
    """
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode: got {mode!r}, allowed: {', '.join(PAUSE_MODES)}")
    return str(mode)



def check_checkpoint_format(is_checkpoint_format: object) -> None:
    """vLLM's `start_weight_update(is_checkpoint_format=...)`: True (its default) says the
    trainer sends tensors in the checkpoint's layout and names, which is what ringserve's
    loader takes; False (tensors already in the engine's kernel layout) has no meaning here.

    Raises:
        ValueError: anything but True, naming the field.
    """
    if is_checkpoint_format is not True:
        raise ValueError(f"is_checkpoint_format: got {is_checkpoint_format!r}, allowed: true "
                         "(ringserve loads the trainer's tensors in the checkpoint's layout "
                         "through the model's loader; a kernel-layout update is not supported)")

class SyncRLMethods:
    """For `LLM` (its `llm_engine` calls the engine core's utilities)."""

    llm_engine: LLMEngine

    def _utility(self, method: str, *args: Any) -> Any:
        return self.llm_engine.call_utility(method, *args)

    def pause(self, mode: str = "abort") -> None:
        """Stop generating (see the module docstring for the modes).

        Raises:
            ValueError: an unknown mode.
        """
        self._utility("pause", check_pause_mode(mode))

    def resume(self) -> None:
        """Undo `pause`."""
        self._utility("resume")

    def is_paused(self) -> bool:
        """True while paused."""
        return bool(self._utility("is_paused"))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Open the channel from a trainer (vLLM's phase 1; the engine must be started with
        `weight_transfer_config`)."""
        self._utility("init_weight_transfer_engine", init_info)

    def start_weight_update(self, metadata: dict[str, Any] | None = None, *,
                            is_checkpoint_format: bool = True) -> None:
        """Begin a weight update; `metadata` (`{"names", "dtype_names", "shapes"}`) is
        checked against the model before any byte is copied.

        Raises:
            ValueError: `is_checkpoint_format=False` (see `check_checkpoint_format`).
        """
        check_checkpoint_format(is_checkpoint_format)
        self._utility("start_weight_update", metadata)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one bucket of tensors (the transport's `update_info`)."""
        self._utility("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Serve the new weights from the next step on, as `weight_version`."""
        self._utility("finish_weight_update", weight_version)

    def get_world_size(self, include_dp: bool = True) -> int:
        """The engine's workers: TP x DP (without DP: TP), as vLLM's `/get_world_size`; a
        gloo / NCCL trainer group has this many members plus the trainer."""
        return world_size(self.llm_engine.config, include_dp)

    def get_weight_version(self) -> str | None:
        """The version of the weights being served (None: the start-up weights)."""
        version: str | None = self._utility("get_weight_version")
        return version

    def collective_rpc(self, method: str, args: tuple[Any, ...] | list[Any] = (),
                       timeout: float | None = None) -> list[Any]:
        """Call an allow-listed worker method on every worker (rank order); see
        `ringserve.engine.core.weight_sync.RPC_METHODS`."""
        results: list[Any] = self._utility("collective_rpc", method, list(args), timeout)
        return results


class AsyncRLMethods:
    """For `AsyncLLM` (which provides `call_utility` over every core and `output_processor`)."""

    output_processor: Any
    config: EngineConfig
    call_utility: Callable[..., Awaitable[list[Any]]]  # AsyncLLM's

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating on every core (see the module docstring); with "wait", returns
        once every request in flight has finished.

        Raises:
            ValueError: an unknown mode.
        """
        await self.call_utility("pause", check_pause_mode(mode))
        if mode == "wait":
            await self.wait_until_idle()

    async def wait_until_idle(self) -> None:
        """Return once this frontend has no request in flight."""
        processor = self.output_processor
        while processor.has_unfinished_requests():
            # Finishing requests is the output handler's work; this is an admin call, not a
            # hot loop, so it looks again every few milliseconds.
            await trio.sleep(0.005)

    async def resume(self) -> None:
        """Undo `pause` on every core."""
        await self.call_utility("resume")

    async def is_paused(self) -> bool:
        """True while any core is paused."""
        return any(await self.call_utility("is_paused"))

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """See `SyncRLMethods.init_weight_transfer_engine` (every core)."""
        await self.call_utility("init_weight_transfer_engine", init_info)

    async def start_weight_update(self, metadata: dict[str, Any] | None = None, *,
                                  is_checkpoint_format: bool = True) -> None:
        """See `SyncRLMethods.start_weight_update` (every core)."""
        check_checkpoint_format(is_checkpoint_format)
        await self.call_utility("start_weight_update", metadata)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        """See `SyncRLMethods.update_weights` (every core, concurrently)."""
        await self.call_utility("update_weights", update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """See `SyncRLMethods.finish_weight_update` (every core)."""
        await self.call_utility("finish_weight_update", weight_version)

    def get_world_size(self, include_dp: bool = True) -> int:
        """See `SyncRLMethods.get_world_size`."""
        return world_size(self.config, include_dp)

    async def get_weight_version(self) -> str | None:
        """The version core 0 serves (every core gets the same updates)."""
        versions = await self.call_utility("get_weight_version")
        version: str | None = versions[0]
        return version

    async def collective_rpc(self, method: str, args: tuple[Any, ...] | list[Any] = (),
                             timeout: float | None = None) -> list[Any]:
        """See `SyncRLMethods.collective_rpc`: every core's workers, core by core."""
        results = await self.call_utility("collective_rpc", method, list(args), timeout)
        return [value for core in results for value in core]
