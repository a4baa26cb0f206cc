"""A local DNS server for tests: answers A and SRV queries from dicts the test changes while it runs."""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from loadtests.processes import free_port


class DnsStub:
    def __init__(self) -> None:
        self.port = free_port()
        self.a: dict[str, list[str]] = {}
        self.srv: dict[str, list[tuple[str, int]]] = {}
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", self.port))
        self._socket.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dns stub", daemon=True)

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> DnsStub:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._socket.recvfrom(4096)
            except TimeoutError:
                continue
            query = dns.message.from_wire(data)
            response = dns.message.make_response(query)
            question = query.question[0]
            name = question.name.to_text().rstrip(".")
            if question.rdtype == dns.rdatatype.A and self.a.get(name):
                response.answer.append(dns.rrset.from_text(f"{name}.", 5, "IN", "A", *self.a[name]))
            elif question.rdtype == dns.rdatatype.SRV and self.srv.get(name):
                records = [f"0 10 {port} {target}." for target, port in self.srv[name]]
                response.answer.append(dns.rrset.from_text(f"{name}.", 5, "IN", "SRV", *records))
            else:
                response.set_rcode(dns.rcode.NXDOMAIN)
            self._socket.sendto(response.to_wire(), peer)
