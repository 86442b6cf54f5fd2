"""The coordinator's answer to a device's hello, and to a device it does not know.

MQTT 3.1.1 cannot tell a publisher that a broker's ACL dropped its message, so a device
learns it is heard only from the coordinator (agent/link.py):

- to a fresh hello (issued within ANSWER_WITHIN_S: not a retained one re-read at a restart,
  which would make every device's hello a command at every coordinator start) the
  coordinator sends a signed `ping` command on the device's cmd topic, cmd_id
  `hello-<the hello's seq>`; the agent takes it as the answer and sends no `pong`;
- to a state or progress signed by a key it does not know (its hello was lost: dropped by
  the ACL before it was fixed, or the registry was reset) it sends a signed `refusal`
  (`unknown_key`) on the device's ack topic, and the agent sends its hello again.

Both are plain messages of the existing schema: an agent that predates them answers the
ping with a pong and logs the refusal.
"""

from __future__ import annotations

import time

from .envelope import Message, Rejection, Signer
from .schema import Kind, Reason
from .topics import Topics

ANSWER_PREFIX = "hello-"
ANSWER_WITHIN_S = 600.0  # a hello older than this is a retained copy, not a device that just connected
ANSWER_TTL_S = 600.0
ASK_AGAIN_CHANNELS = ("state", "progress")


def hello_answer(signer: Signer, topics: Topics, hello: Message, *, now: float | None = None,
                 ) -> tuple[str, bytes] | None:
    """(topic, payload) of the ping that answers `hello`, or None for an old (retained) one."""
    if hello.kind is not Kind.HELLO or hello.route.device is None:
        return None
    if (time.time() if now is None else now) - hello.issued_at > ANSWER_WITHIN_S:
        return None
    topic = topics.device(hello.route.device, "cmd")
    body = {"cmd_id": f"{ANSWER_PREFIX}{hello.seq}", "action": "ping"}
    return topic, signer.control(topic, Kind.CMD, body, ttl=ANSWER_TTL_S)


def ask_for_hello(signer: Signer, topics: Topics, rejection: Rejection, *, ttl: float = 3600.0,
                  ) -> tuple[str, bytes] | None:
    """(topic, payload) of the `unknown_key` refusal that makes a device send its hello again,
    for a state or progress message from an unknown key; None for anything else."""
    route = rejection.route
    if rejection.reason != Reason.UNKNOWN_KEY or route is None or route.device is None or \
            route.channel not in ASK_AGAIN_CHANNELS:
        return None
    topic = topics.device(route.device, "ack")
    body = rejection.refusal_body()
    body["detail"] = (f"the coordinator does not know device {route.device} (no hello from it): "
                      "send the hello again")[:512]
    return topic, signer.control(topic, Kind.REFUSAL, body, ttl=ttl)
