"""Sleep and wake-up of a lockstep deployment (DP + expert parallelism): every core together.

Each core of a lockstep deployment holds a share of the experts and every MoE layer is a
collective over all of them (`ringserve.engine.core.dp_wave`), so one core cannot sleep at
level 2 while another serves (its experts leave with its weights; the other's next exchange
timed out into an engine fault), nor serve while another still loads its weights. As vLLM's
`/sleep` on a data-parallel deployment, `sleep` and `wake_up` reach every core, here all or
none (`AsyncMPClient.call_utility` routes them here):

1. every core holds new requests (`hold_new_requests`) and says how many are in flight;
2. `sleep` with any in flight fails as a single core's does (ValueError) and no core sleeps;
3. otherwise the call goes to every core (one that is inside a wave applies a sleep when the
   wave ends: `ringserve.engine.core.lockstep_proc`);
4. the holds are lifted (`release_new_requests`, shielded from cancellation): asleep, new
   requests stay held until the wake-up; awake, they are queued, and the wave they start
   finds every core awake.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

# The utility methods that go through `call_together` on a lockstep deployment.
TOGETHER = frozenset({"sleep", "wake_up"})


async def call_together(call: Callable[..., Awaitable[list[Any]]], method: str,
                        *args: Any) -> list[Any]:
    """Run `method` ("sleep" or "wake_up") on every core of a lockstep deployment at once.

    Args:
        call: calls a utility on every core; results in core order.
        method: "sleep" or "wake_up".
        args: the method's arguments.

    Returns:
        The cores' results, in core order.

    Raises:
        ValueError: `sleep` while requests are in flight on some core (nothing slept), or a
            core refused the call.
    """
    try:
        in_flight = await call("hold_new_requests")  # sent before a cancel can land: inside
        busy = sum(int(n) for n in in_flight)
        if method == "sleep" and busy:
            raise ValueError(f"sleep: {busy} requests are in flight on the engine cores (the "
                             "cores of an expert-parallel deployment sleep together); abort "
                             "them or pause(mode='wait') until they finish")
        return await call(method, *args)
    finally:
        with trio.CancelScope(shield=True):
            await call("release_new_requests")
