"""Parley's benchmarks: one entry point, `python -m bench <name>` (or `parley-bench <name>`; bench/__main__.py).

The runs that start servers are declared as data in bench/runs.py and carried out by bench/runner.py with the
shared helpers (bench/server.py: start a server, wait for /health, stop it; bench/device.py: the device and
versions; bench/publish.py: JSON + Markdown + plot into bench/results/); bench/e2e_report.py and
bench/voice_report.py fold their raw folders into reports."""
