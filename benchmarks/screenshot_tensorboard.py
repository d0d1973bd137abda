#!/usr/bin/env python
"""A PNG of TensorBoard's time-series page for a job's events, for the docs (needs ``chromium`` on PATH).

Starts TensorBoard on the events folder and a headless Chromium, waits until the charts are drawn (TensorBoard
draws in a worker after its data arrives: ``--virtual-time-budget`` screenshots come out empty), and captures
the page through Chromium's DevTools protocol (a minimal WebSocket client from the standard library: no extra
dependency for one figure).

    python benchmarks/screenshot_tensorboard.py --logdir outputs/debug_tiny_rl/tb --out docs/figures/tensorboard_balance.png
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request

TAGS = "step_mean_max_over_mean|step_static_max_over_mean|step_planned_max_over_mean|reward_mean"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_json(url: str, seconds: float):
    t0 = time.time()
    while True:
        try:
            return json.load(urllib.request.urlopen(url, timeout=2))
        except Exception:
            if time.time() - t0 > seconds:
                raise RuntimeError(f"no answer from {url} within {seconds:.0f} s")
            time.sleep(0.3)


class _WebSocket:
    """Text frames over one TCP connection (RFC 6455: client frames masked, server frames not)."""

    def __init__(self, url: str):
        u = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=120)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise RuntimeError(f"websocket handshake refused: {head.decode(errors='replace')}")

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise RuntimeError("websocket closed")
            buf += chunk
        return buf

    def send(self, text: str) -> None:
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                                bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 else
                                bytes([0x80 | 127]) + struct.pack(">Q", n))
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            n = struct.unpack(">H", self._read(2))[0] if n == 126 else struct.unpack(">Q", self._read(8))[0] if n == 127 else n
            parts.append(self._read(n))
            if b0 & 0x80:
                return b"".join(parts).decode()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tags", default=TAGS, help="TensorBoard's tag filter (a regular expression)")
    ap.add_argument("--wait-s", type=float, default=25.0, help="seconds for the charts to draw")
    ap.add_argument("--size", default="1600,900")
    a = ap.parse_args(argv)
    tb_port, cdp_port = _free_port(), _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", a.logdir, "--port", str(tb_port),
                               "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_json(f"http://127.0.0.1:{tb_port}/data/runs", 60)
        procs.append(subprocess.Popen(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu",
                                       f"--remote-debugging-port={cdp_port}", "--remote-allow-origins=*",
                                       f"--window-size={a.size}", "about:blank"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        page = next(t for t in _wait_json(f"http://127.0.0.1:{cdp_port}/json", 60) if t["type"] == "page")
        ws, ids = _WebSocket(page["webSocketDebuggerUrl"]), iter(range(1, 1 << 30))

        def call(method, **params):
            i = next(ids)
            ws.send(json.dumps({"id": i, "method": method, "params": params}))
            while (m := json.loads(ws.recv())).get("id") != i:
                pass
            return m.get("result", {})

        w, h = (int(x) for x in a.size.split(","))
        call("Emulation.setDeviceMetricsOverride", width=w, height=h, deviceScaleFactor=1, mobile=False)
        call("Page.navigate", url=f"http://127.0.0.1:{tb_port}/?tagFilter={urllib.parse.quote(a.tags)}#timeseries")
        time.sleep(a.wait_s)
        call("Runtime.evaluate", expression=(  # a fresh profile opens the settings pane: close it for the charts' room
            "[...document.querySelectorAll('button')].filter(b => /close/i.test(b.getAttribute('aria-label') || ''))"
            ".forEach(b => b.click())"))
        time.sleep(3)
        png = base64.b64decode(call("Page.captureScreenshot", format="png")["data"])
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "wb") as f:
            f.write(png)
        print(f"wrote {a.out} ({len(png)} bytes)")
    finally:
        for p in procs:
            p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
