"""`pytest --compile-report`: where the suite's time goes, per test file. The suite compiles far
more than it runs (most of a file's time is XLA compiling and JAX tracing its programs), so a
file is shown with its wall time, the seconds JAX reports spending on tracing and lowering and
on compiling (or reading a compiled program from the persistent compilation cache), how many
programs it asked for, and how many of those the cache held. Under xdist each worker counts
its own tests and the controller adds them up. The processes a test starts (the README's
blocks, several processes, the examples run as scripts) are in its wall time only.

Loaded by tests/conftest.py; off unless asked for."""

import collections
import json
import time

import pytest


OPTION = "--compile-report"
# JAX's monitoring events (jax/_src/dispatch.py, jax/_src/compiler.py), by the column they add to.
_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits"}
_COLUMNS = ("wall", "trace", "compile", "programs", "cache_hits")


def pytest_addoption(parser) -> None:
    parser.addoption(
        OPTION,
        action="store_true",
        help="print, per test file, the seconds spent tracing and compiling JAX programs, how "
        "many programs were asked for and how many of those the persistent cache held",
    )


class _Report:
    """This process's counts, per test file (`{file: {column: value}}`)."""

    def __init__(self) -> None:
        self.files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.current: str | None = None

    def listen(self) -> None:
        from jax import monitoring

        def duration(event: str, seconds: float, **_) -> None:
            column = _DURATIONS.get(event)
            if column is not None and self.current is not None:
                self.files[self.current][column] += seconds
                if column == "compile":
                    self.files[self.current]["programs"] += 1

        def count(event: str, **_) -> None:
            column = _EVENTS.get(event)
            if column is not None and self.current is not None:
                self.files[self.current][column] += 1

        monitoring.register_event_duration_secs_listener(duration)
        monitoring.register_event_listener(count)

    def add(self, files: dict) -> None:
        for name, counts in files.items():
            self.files[name].update(counts)


_KEY = pytest.StashKey[_Report]()


def pytest_configure(config) -> None:
    if config.getoption(OPTION):
        report = _Report()
        report.listen()
        config.stash[_KEY] = report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    report = item.config.stash.get(_KEY, None)
    if report is None:
        yield
        return
    report.current = item.path.name
    start = time.perf_counter()
    yield
    report.files[item.path.name]["wall"] += time.perf_counter() - start
    report.current = None


def pytest_sessionfinish(session) -> None:
    # An xdist worker hands its counts to the controller (`pytest_testnodedown`).
    report = session.config.stash.get(_KEY, None)
    if report is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["compile_report"] = json.dumps(report.files)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    report = node.config.stash.get(_KEY, None)
    output = getattr(node, "workeroutput", {}).get("compile_report")
    if report is not None and output is not None:
        report.add(json.loads(output))


def pytest_terminal_summary(terminalreporter, config) -> None:
    report = config.stash.get(_KEY, None)
    if report is None or hasattr(config, "workerinput"):
        return
    write = terminalreporter.write_line
    terminalreporter.section("compile report (seconds; programs asked for, cache hits)")
    write(f"{'file':34s} {'wall':>8s} {'trace':>8s} {'compile':>8s} {'programs':>9s} {'hits':>6s}")
    total = collections.Counter()
    for name, counts in sorted(report.files.items(), key=lambda kv: -kv[1]["wall"]):
        total.update(counts)
        write(_row(name, counts))
    write(_row("all", total))


def _row(name: str, counts: collections.Counter) -> str:
    wall, trace, compile_, programs, hits = (counts[c] for c in _COLUMNS)
    return f"{name:34s} {wall:8.2f} {trace:8.2f} {compile_:8.2f} {programs:9.0f} {hits:6.0f}"
