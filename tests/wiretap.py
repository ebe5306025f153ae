"""A recording TCP relay on 127.0.0.1: everything that crosses it, both directions, is kept."""
import socket
import threading


class Wiretap:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        self.streams: list[bytearray] = []  # one per connection and direction
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # the SuperLink is going away: drop this connection
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        stream = bytearray()
        with self.lock:
            self.streams.append(stream)
        try:
            while data := src.recv(65536):
                with self.lock:
                    stream += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def captured(self) -> list[bytes]:
        with self.lock:
            return [bytes(s) for s in self.streams]

    def close(self) -> None:
        self.closed = True
        self.server.close()
