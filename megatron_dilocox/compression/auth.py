"""Authenticated payloads: an HMAC-SHA256 tag on every message a round puts on the wire between clusters.

gloo between sites is neither encrypted nor authenticated, so anyone on the path could alter or inject a
pseudo-gradient, and the cluster that received it would apply it. Each message therefore carries a 32-byte tag,
HMAC-SHA256 under a key derived from the shared secret and the run's session (the rendezvous challenge, so
no tag from another run verifies), over what the message is and where it belongs:

    (session key)  round, fragment, message kind, sender cluster, receiver cluster (-1: every member),
                   dtype, number of bytes  ||  the bytes

A receiver recomputes the tag and refuses a message whose tag differs: altered on the way (a flipped bit),
replayed from an earlier round or fragment, sent to another receiver or posing as another sender. The refusal
(``ForgedPayload``) names the sender and the round; the membership protocol then treats that sender as lost for
the round (net/membership.py): nothing from it is applied, the others go on without it under
``--dilocox-on-peer-failure continue`` and stop cleanly under ``stop``.

Confidentiality is not the point (pseudo-gradients still travel in clear; a tunnel between sites gives that);
integrity is, and it is cheap where the payload is built: SHA-256 runs at about a GB/s per core here, far above
a WAN link, and the exchange runs in a background thread (docs/security.md#authenticated-payloads). Pure
PyTorch and the standard library.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Optional

import torch

TAG_BYTES = 32


class ForgedPayload(RuntimeError):
    """A message whose tag does not verify: altered, replayed or misrouted. Nothing from it was applied."""

    def __init__(self, sender: int, round_idx: int, kind: str):
        self.sender, self.round = sender, round_idx
        super().__init__(f"DiLoCoX round {round_idx}: refused the {kind} message from cluster {sender}: its "
                         f"authentication tag does not verify (altered, replayed from another round, or misrouted "
                         f"on the way); nothing from cluster {sender} was applied")


def derive_key(secret: Optional[str], session: str) -> bytes:
    """The run's payload key: HMAC(secret, 'dilocox-payload|' + session). One per rendezvous session."""
    return hmac.new((secret or "").encode(), b"dilocox-payload|" + session.encode(), hashlib.sha256).digest()


def tag(key: bytes, context: tuple, sender: int, receiver: int, payload: torch.Tensor) -> torch.Tensor:
    """The 32-byte tag of ``payload`` (a flat uint8 tensor) in ``context`` = (round, fragment, kind, ...)."""
    round_idx, fragment, kind = context[0], context[1], kind_of(context)
    mac = hmac.new(key, struct.pack("<qqqq", int(round_idx), int(fragment), int(sender), int(receiver))
                   + f"|{kind}|{payload.dtype}|{payload.numel()}|".encode(), hashlib.sha256)
    mac.update(memoryview(payload.contiguous().numpy()))  # no copy of the payload
    return torch.frombuffer(bytearray(mac.digest()), dtype=torch.uint8)


def kind_of(context: tuple) -> str:
    return "/".join(map(str, context[2:]))


def seal(key: bytes, context: tuple, sender: int, receiver: int, payload: torch.Tensor) -> torch.Tensor:
    """``payload`` with its tag appended (what goes on the wire)."""
    return torch.cat([payload, tag(key, context, sender, receiver, payload)])


def unseal(key: bytes, context: tuple, sender: int, receiver: int, message: torch.Tensor) -> torch.Tensor:
    """The payload of a sealed ``message``, or ``ForgedPayload`` naming the sender and the round."""
    payload, got = message[:-TAG_BYTES], message[-TAG_BYTES:]
    want = tag(key, context, sender, receiver, payload)
    if message.numel() < TAG_BYTES or not hmac.compare_digest(bytes(got.numpy()), bytes(want.numpy())):
        raise ForgedPayload(sender, int(context[0]), kind_of(context))
    return payload
