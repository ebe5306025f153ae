"""Secure aggregation as the engines run it: the protocol of fedsilo.privacy.secagg around the silos'
masked vectors (fedsilo.core.masking), ending in `Server.receive_sum`.

In-process every silo's protocol client runs here, one after another; the server object is handed
only the sum. A silo that refused the round after the keys were shared (its own check, a spent
privacy budget) is a dropout the protocol recovers from.
"""
from __future__ import annotations

import numpy as np

from fedsilo.config import SecureAggregationConfig
from fedsilo.privacy.secagg import SecAggSettings, secure_sum
from fedsilo.server import Server


def protocol_settings(secure: SecureAggregationConfig) -> SecAggSettings:
    return SecAggSettings(threshold=secure.threshold, step=secure.step)


def sum_in_process(server: Server, masked: dict, sampled: list[str], secure: SecureAggregationConfig,
                   round_id: str) -> str | None:
    """Run the protocol over the sampled silos (those without a vector drop after key sharing) and give
    the server the sum. Returns why the round has no sum, or None."""
    if not masked:
        server.secure_failed("no silo sent a masked update")
        return "secure aggregation: no silo sent a masked update"
    length = len(next(iter(masked.values())).secure_input)
    inputs = {s: (masked[s].secure_input if s in masked else np.zeros(length)) for s in sampled}
    dropped = [s for s in sampled if s not in masked]
    try:
        total, survivors = secure_sum(inputs, protocol_settings(secure), drop_after_share=dropped, round_id=round_id)
    except ValueError as err:
        server.secure_failed(str(err), masked)
        return f"secure aggregation: {err}"
    return server.receive_sum(total, server.secure_layout(), {s: masked[s] for s in survivors},
                              {"survivors": list(survivors), "dropped": dropped})
