"""Secure aggregation as the engines run it: the protocol of fedsilo.privacy.secagg around the silos'
masked vectors (fedsilo.core.masking), ending in `Server.receive_sum`.

In-process every silo's protocol client runs here, one after another; the server object is handed
only the sum. A silo that refused the round after the keys were shared (its own check, a spent
privacy budget) is a dropout the protocol recovers from. One operator runs every silo here, so
there is no server to lie to them: each round gets fresh signing keys and a roster made for it, so
that the same signed stages and consistency round run as on a federation. The round commitment is
empty here (every silo trains from the one model this process holds); on Flower each silo makes its own
(fedsilo.engines.flower.client_app).
"""
from __future__ import annotations

import numpy as np

from fedsilo.config import SecureAggregationConfig
from fedsilo.privacy.secagg import SecAggSettings, colluders_tolerated, secure_sum
from fedsilo.server import Server

SEMI_HONEST = ("secure aggregation without a roster: only the semi-honest guarantee holds (a server that lies, "
               "by swapping keys or showing silos different survivor sets, can learn one silo's update); give "
               "every silo's SuperNode node config roster=\"FILE\" and signing-key=\"FILE\" (docs/privacy.md)")


def protocol_settings(secure: SecureAggregationConfig) -> SecAggSettings:
    return SecAggSettings(threshold=secure.threshold, step=secure.step)


def guarantee(n: int, threshold: int, roster: str | None) -> dict:
    """What the round's record says the protocol guaranteed: against which server, with how many colluding silos."""
    return {"against": "active server" if roster else "semi-honest server only", "roster": roster,
            "threshold": threshold, "colluding_silos_tolerated": colluders_tolerated(n, threshold, roster is not None)}


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
    settings = protocol_settings(secure)
    try:
        t = settings.threshold_for(len(sampled))
        signed = 2 * t > len(sampled)  # a roster is refused below a majority (there, no roster defends anyway)
        total, survivors = secure_sum(inputs, settings, drop_after_share=dropped, round_id=round_id, signed=signed)
    except ValueError as err:
        server.secure_failed(str(err), masked)
        return f"secure aggregation: {err}"
    return server.receive_sum(total, server.secure_layout(), {s: masked[s] for s in survivors},
                              {"survivors": list(survivors), "dropped": dropped,
                               **guarantee(len(sampled), t, "ephemeral, in-process" if signed else None)})
