"""HTTP/1.1 connections with a deadline for the request headers.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), but a
client that opens a connection and sends its headers a byte at a time, or never finishes them, holds the
connection (and its file descriptor) for ever: 50 such connections were still open after 60 s. Here every
request's headers must be complete within `header_timeout_s` of its first byte (of the connection's
opening for the first request), and its body within `body_timeout_s` of the headers; otherwise the
connection is closed. (The request timeout starts once the body is parsed: a client sending its body at a
byte a second held its connection for 150 s, and held up shutdown.) Bodies are bounded by the app's size
limit.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_timeout(header_timeout_s: float, body_timeout_s: float = 30.0) -> type[H11Protocol]:
  """uvicorn's h11 protocol class (pass as `http=`) with the headers and body deadlines."""
  if not header_timeout_s > 0:
    raise ValueError(f"header_timeout_s={header_timeout_s!r}: must be > 0")
  if not body_timeout_s > 0:
    raise ValueError(f"body_timeout_s={body_timeout_s!r}: must be > 0")

  class HeaderDeadlineProtocol(H11Protocol):
    _header_task: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float = header_timeout_s) -> None:
      if self._header_task is None:
        self._header_task = self.loop.call_later(seconds, self._headers_late)

    def _disarm(self) -> None:
      if self._header_task is not None:
        self._header_task.cancel()
        self._header_task = None

    def _headers_late(self) -> None:
      self._header_task = None
      if not self.transport.is_closing():
        self.transport.close()

    def connection_made(self, transport) -> None:  # type: ignore[override]
      super().connection_made(transport)
      self._arm()

    def data_received(self, data: bytes) -> None:
      if self.cycle is None or self.cycle.response_complete:  # bytes of a new request's head
        self._arm()
      super().data_received(data)

    def handle_events(self) -> None:
      before = self.cycle
      super().handle_events()
      if self.cycle is not before:  # a request's headers are complete: now its body has its own deadline
        self._disarm()
        if self.cycle is not None and self.cycle.more_body:
          self._arm(body_timeout_s)
      elif self.cycle is not None and not self.cycle.more_body and not self.cycle.response_complete:
        self._disarm()  # the body is complete: the app's request timeout takes over

    def connection_lost(self, exc) -> None:
      self._disarm()
      super().connection_lost(exc)

  return HeaderDeadlineProtocol
