"""One access-log line per request, plain or JSON lines."""

from __future__ import annotations

import logging
import time

import orjson

log = logging.getLogger("xllm_async.access")


class AccessRecord:
    """What a route notes about its request for the log line."""

    __slots__ = ("request_id", "prompt_tokens", "output_tokens", "queue_time", "ttft")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.queue_time: float | None = None
        self.ttft: float | None = None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class AccessLog:
    def __init__(self, style: str) -> None:
        self.style = style  # plain, json or off

    def write(self, request, responder) -> None:
        if self.style == "off" or request is None:
            return
        record: AccessRecord | None = responder.record
        total = time.monotonic() - request.received
        fields = {
            "client": request.client, "method": request.method, "path": request.path, "status": responder.status,
            "bytes": responder.bytes_sent, "total_ms": _ms(total),
            "request_id": record.request_id if record else None,
            "prompt_tokens": record.prompt_tokens if record else 0,
            "output_tokens": record.output_tokens if record else 0,
            "queue_ms": _ms(record.queue_time) if record else None,
            "ttft_ms": _ms(record.ttft) if record else None,
        }
        if self.style == "json":
            log.info(orjson.dumps(fields).decode())
        else:
            log.info('%s "%s %s" %s %sB prompt=%s output=%s queue=%sms ttft=%sms total=%sms id=%s',
                     fields["client"], request.method, request.path, responder.status, responder.bytes_sent,
                     fields["prompt_tokens"], fields["output_tokens"], fields["queue_ms"], fields["ttft_ms"],
                     fields["total_ms"], fields["request_id"])
