"""HTTP/1.1 connections with a deadline for the request headers.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), but a
client that opens a connection and sends its headers a byte at a time, or never finishes them, holds the
connection (and its file descriptor) for ever: 50 such connections were still open after 60 s. Here every
request's headers must be complete within `header_timeout_s` of its first byte (of the connection's
opening for the first request); otherwise the connection is closed. Bodies are bounded by the app's size
limit and the request timeout.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
  """uvicorn's h11 protocol class (pass as `http=`) with the headers deadline."""
  if not header_timeout_s > 0:
    raise ValueError(f"header_timeout_s={header_timeout_s!r}: must be > 0")

  class HeaderDeadlineProtocol(H11Protocol):
    _header_task: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
      if self._header_task is None:
        self._header_task = self.loop.call_later(header_timeout_s, self._headers_late)

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
      if self.cycle is not before:  # a request's headers are complete
        self._disarm()

    def connection_lost(self, exc) -> None:
      self._disarm()
      super().connection_lost(exc)

  return HeaderDeadlineProtocol
