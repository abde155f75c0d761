"""The Loom player: a video source in, the engine's restyled frames out to a window, files and streams.

Two ways to run, chosen from the input (`--mode` overrides):
- lossless (files, the generated clip): every input frame is restyled, in order, through the
  bridge's batch path; the output file has exactly as many frames as were read, and the run
  takes as long as the engine needs. A progress bar shows how far it is.
- live (cameras, network inputs, or `--mode live`): the input runs at its own rate; each input
  frame is submitted (latest wins) and the newest engine output (or the fallback while the
  engine starts or restarts) goes out at once. A status line shows FPS, latency and drops.

Outputs are finalised on every exit path, including Ctrl-C and the SIGTERM/SIGHUP that a process
manager or a closed terminal sends, so a file written so far plays.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loom_live.host_bridge import EngineState, Interrupted
from loom_live.host_bridge.wire.errors import UserError
from loom_live.host_bridge.wire.params import CONTROL, PROMPT_TAKES
from loom_live.plugin.media.base import MediaError
from loom_live.plugin.media.generated_clip import generate_clip
from loom_live.plugin.media.network_output import StreamCutOff
from loom_live.plugin.media.sinks import open_sink
from loom_live.plugin.media.sources import open_source
from loom_live.plugin.media.stop_signals import signals_deferred
from loom_live.plugin.player.control_input import ControlInput, open_control_input
from loom_live.plugin.player.controls import Command, Controls, ControlState, KeyboardInput, served_sources
from loom_live.plugin.player.live_feed import LiveFeed
from loom_live.plugin.player.options import (
    DEFAULT_GENERATED_FRAMES,
    DEFAULT_GENERATED_SIZE,
    DEFAULT_OUTPUT,
    DEFAULT_STARTUP_TIMEOUT_S,
    EXIT_BAD_INPUT,
    EXIT_ENGINE_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    WINDOW_OUTPUT,
    PlayerError,
    PlayerOptions,
    output_kind,
)
from loom_live.plugin.player.status import StatusPrinter, live_line
from loom_live.plugin.player.stop_requests import StopRequested, StopSignals, stop_outcome
from loom_live.plugin.player.style_line import StyleReport

# An engine that restarts this many times before it ever runs is broken, not slow: give up.
MAX_FAILED_STARTS = 3
RETRY_PAUSE_S = 1.0
# Seconds a lossless run waits for the engine's next frame (beyond the start-up timeout) before it is declared stuck.
PROCESS_TIMEOUT_S = 120.0
PAUSE_POLL_S = 0.05
# A live input late by this much is stalled: the last picture is held (at the input's rate) until it is back.
STALL_GRACE_S = 0.5
READY_POLL_S = 0.1
# A live run looks at the engine's last report (polled by the bridge every second) this often for a new style.
STYLE_POLL_S = 0.25
# A file that ends short of the frame count its header states by more than the larger of these is said to (a copy
# cut short, a file truncated mid-run); less is the header's approximation (a count estimated from the duration).
SHORT_INPUT_FRAMES = 3
SHORT_INPUT_SHARE = 0.05


class Player:
    """One run: open the source, the engine bridge and the outputs; stream; close everything."""

    def __init__(self, options: PlayerOptions, printer: StatusPrinter | None = None) -> None:
        options.check()
        self.opts = options
        self.name = options.command  # what its lines start with: the command the user typed
        self.printer = printer or StatusPrinter(quiet=options.quiet)
        prompts = list(options.prompts) or [options.default_prompt]
        # a served engine (--endpoint) runs its own config: its family, the parameters it takes and its starting
        # values are known once it says them (_follow_engine); nothing is sent to it before. A launched one runs -c's
        # until it says its own
        family, takes = (None, frozenset()) if options.endpoint else \
            (options.family, None if options.takes is None else frozenset(options.takes))
        self.controls = Controls(ControlState(prompts=prompts, steps=options.steps,
                                              noise_scale=options.noise_scale,
                                              motion_aware=options.motion_aware,
                                              lora_scales=dict(options.lora_scales),
                                              control_sources=tuple(options.control_sources),
                                              takes_reference=options.takes_reference,
                                              control_source=options.control_source,
                                              context_scale=options.context_scale,
                                              adapter_strength=options.adapter_strength,
                                              reference=options.reference, family=family, takes=takes),
                                 on_quit=self._stop_outputs)
        self.keyboard = KeyboardInput(self.controls)
        self.style = StyleReport()  # which of the model's styles the prompt landed on (none for Wan presets)
        self._style_polled = 0.0
        self._errors_said = 0  # the engine's error count already said (_say_engine_news)
        self._standby_said: tuple[int | None, int | None] = (None, None)  # (engine pid, ready standby pid) said
        self._took_start = False  # a served engine's starting settings were taken (_take_start)
        self._followed = False  # the ready engine's family and settings were read (_follow_engine)
        self.source: Any = None
        self.feed: LiveFeed | None = None  # a camera or stream in a live run: read on its own thread
        self.control_input: ControlInput | None = None  # VACE: --control-input, read beside the input
        self._control: np.ndarray | None = None  # the control frame of the last frame read (None: grey)
        self._sent_control: np.ndarray | None = None  # ... of the last frame handed to a lossless stream
        self._holding = False
        self.bridge: Any = None
        self.stops = StopSignals(self._interrupt_bridge)  # a stop signal held back while the bridge runs
        self.sinks: list[Any] = []
        self.window: Any = None
        self.osc: Any = None
        self.web: Any = None  # the web page (plugin/web), with --web
        self.frames_in = 0
        self.frames_out = 0
        # live: frames that went out as the input (the engine starting or restarting), said at the end, since a
        # short run can end before the first restyled frame and its file would otherwise look restyled
        self.unrestyled_out = 0
        self.size: tuple[int, int] = (0, 0)
        self._scaled = False  # --size on an input: every frame is scaled to it
        self._last_out: np.ndarray | None = None
        self._started = time.monotonic()
        # A restart starts a new, empty log: keep the last tail and engine error that said something.
        self._log_tail: list[str] = []
        self._last_error = ""
        # An input that breaks mid-stream ends the reading; the frames read before it still go out.
        self._input_error: PlayerError | None = None
        self._input_ended = False  # the input reached its end (not --frames, a quit, or a failure to read)
        self._skipped_reported = 0
        self._last_input_shape: tuple[int, ...] = ()  # of the last frame not at the source's size
        self._unfinished: list[str] = []  # outputs that failed, mid-run or finalising: the user must hear of it
        # streams given up on at the user's stop, their receiver taking nothing: said, but the stop's doing (exit 0)
        self._cut_off: list[str] = []

    # --- set-up ------------------------------------------------------------------------------

    def _open_source(self) -> None:
        o = self.opts
        try:
            if o.uses_web_camera:
                self.source = self._web_camera()
            elif o.uses_generated_clip:
                n = o.max_frames or DEFAULT_GENERATED_FRAMES
                self.source = generate_clip(n, size=o.size or DEFAULT_GENERATED_SIZE, fps=o.fps, seed=o.seed)
            else:
                self.source = open_source(o.input)
        except MediaError as exc:
            raise PlayerError(f"input: {exc}") from None
        w, h = self.source.size
        # H.264 4:2:0 needs even sizes: drop a last odd column/row rather than refuse the input.
        self.size = (w - w % 2, h - h % 2)
        if o.size is not None and o.size != (w, h):  # --size on an input: scaled, never ignored
            if not self._scaled:  # said once (a looped or reconnected input opens again)
                self.printer.say(f"{self.name}: input {w}x{h} scaled to {o.size[0]}x{o.size[1]} (--size)")
            self.size, self._scaled = o.size, True

    def _open_control_input(self) -> None:
        o = self.opts
        if o.control_input is None:
            return
        self.control_input = open_control_input(o.control_input, self.size,
                                                frames=o.max_frames or DEFAULT_GENERATED_FRAMES, fps=self.source.fps,
                                                seed=o.seed, say=lambda line: self.printer.say(f"{self.name}: {line}"))
        self.printer.say(f"{self.name}: control video from {self.control_input.name} (--control-input)")

    def _web_camera(self) -> Any:
        """The page's camera, the same one again after the feed lost it (only the end of the run closes it)."""
        if self.web.camera.closed:
            raise MediaError("the web page's camera is closed: the run is ending")
        return self.web.camera

    def _open_outputs(self) -> None:
        from loom_live.plugin.player.window import PreviewWindow, WindowUnavailable

        o = self.opts
        audio_from = None if (o.uses_generated_clip or self.source.is_live) else o.input
        specs = list(o.outputs)
        if WINDOW_OUTPUT in specs:
            try:
                self.window = PreviewWindow()
            except WindowUnavailable as exc:
                specs = [s for s in specs if s != WINDOW_OUTPUT] or [DEFAULT_OUTPUT]
                self.printer.say(f"{self.name}: {exc}; running without a window, writing {', '.join(specs)}")
        for spec in specs:
            if spec == WINDOW_OUTPUT:
                continue
            kind = output_kind(spec)
            try:
                self.sinks.append(open_sink(spec, self.source.fps, self.size,
                                            audio_from=audio_from if kind == "file" else None,
                                            overwrite=o.overwrite,
                                            while_waiting=self._poll_window if self.window is not None else None))
            except MediaError as exc:
                raise PlayerError(f"output: {exc}") from None

    def _start_engine(self) -> None:
        from loom_live.host_bridge import Bridge, BridgeConfig

        o = self.opts
        overrides = list(o.overrides)
        if o.prompts:  # the engine starts on the first prompt: no blend in from the config's, its style known at once
            # a YAML string, quoted; not ASCII-escaped: YAML reads an escaped emoji as two broken halves
            overrides.append(f"prompt.text={json.dumps(self.controls.state.prompt, ensure_ascii=False)}")
        cfg = BridgeConfig(transport=o.transport, launch=o.endpoint is None,
                           engine_python=o.engine_python or sys.executable, engine_config=o.config,
                           engine_overrides=overrides, endpoint=o.endpoint, secret_file=o.secret_file,
                           fallback="passthrough", passthrough=o.passthrough, standby=o.standby,
                           hold_cpu_awake=o.hold_cpu_awake)
        try:
            self.bridge = Bridge(cfg)
            self.bridge.start()
        except Exception as exc:  # whatever the launcher raises, the user sees one line and exit code 3
            raise PlayerError(f"cannot start the engine: {exc}", EXIT_ENGINE_FAILED) from None
        if o.hold_cpu_awake:
            awake = self.bridge.stats()["cpu_awake"]
            self.printer.say(f"{self.name}: CPUs held out of deep idle states while the show runs" if awake["held"]
                             else f"{self.name}: --hold-cpu-awake: {awake['why']}")

    def _start_osc(self) -> None:
        if self.opts.osc_port is None:
            return
        from loom_live.plugin.player.osc import OSCServer

        try:
            self.osc = OSCServer(self.controls, self.opts.osc_host, self.opts.osc_port)
        except RuntimeError as exc:
            raise PlayerError(str(exc)) from None
        host, port = self.osc.address
        self.printer.say(f"{self.name}: OSC control on udp://{host}:{port} (addresses: /loom/prompt, /loom/steps, ...)")

    def _start_web(self) -> None:
        """The page: before the input opens for `loom web` (it reads the page's camera), after it beside a
        run (the page's size is the output's); a refused address or unsafe setting ends the run here,
        before an engine starts."""
        o = self.opts
        if o.web is None:
            return
        option = "loom web" if o.uses_web_camera else "--web"  # `loom web` takes the address as its argument
        try:
            from loom_live.plugin.web.access import make_access

            access = make_access(o.web, token_file=o.web_token_file, cert=o.web_cert, key=o.web_key,
                                 proxy=o.web_proxy, option=option)
            from loom_live.plugin.web.ice import ice_servers

            ice = ice_servers(o.ice_servers, username=o.ice_username, credential_file=o.ice_credential_file)
            from loom_live.plugin.web.host import WebHost

            self.web = WebHost(access, self.controls, self._web_size(), o.fps, camera=o.uses_web_camera, ice=ice)
            url = self.web.start()
        except ImportError as exc:
            raise PlayerError(f"{option} needs aiohttp and aiortc: pip install 'loom-live[web]' ({exc})") from None
        except (RuntimeError, UserError) as exc:
            raise PlayerError(str(exc)) from None
        self.printer.say(f"{self.name}: the page is at {url}")

    def _web_size(self) -> tuple[int, int]:
        w, h = self.opts.size if self.opts.uses_web_camera else self.size  # `loom web` always has --size
        return w - w % 2, h - h % 2

    def _wait_ready(self) -> None:
        """Block until the engine answers (lossless mode needs it; live mode shows the fallback)."""
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while True:
            status = self.bridge.status()  # the engine's own state: ready to take frames before it sent any
            self._remember_log(status)
            if _is_ready(status):
                self.printer.end_stage()
                self._follow_engine(status)
                return
            if _is_failed(status) or status.restarts >= MAX_FAILED_STARTS:
                self.printer.end_stage()
                raise self._engine_error("the engine did not start", status)
            if time.monotonic() > deadline:
                raise self._engine_error(f"the engine did not become ready within {self.opts.startup_timeout_s:g} s",
                                         status, hint=f"--startup-timeout S sets the wait, "
                                                      f"{DEFAULT_STARTUP_TIMEOUT_S:g} s by default")
            self.printer.stage(f"{self.name}: starting the engine: {status.message or status.state}")
            self.stops.check()
            self._poll_controls()
            if self.controls.state.quit:
                return
            time.sleep(READY_POLL_S)

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        """Stream until the input ends, `--frames` is reached, or the user quits; returns the exit code."""
        stopped_by, code = "", EXIT_OK
        failed = True  # until the run ends normally or by the user: a failed run keeps no file
        previous_handlers = self.stops.install()
        try:
            if self.opts.uses_web_camera:
                self._start_web()  # the page's camera is the input: the page first
            self._open_source()
            if not self.opts.uses_web_camera:
                self._start_web()  # beside a run: at the input's size, known now
            self._open_control_input()
            self._open_outputs()
            self._start_engine()
            if self.web is not None:
                self.web.attach(self.bridge)
            self._start_osc()
            if self.opts.prompts:  # the bridge tells the engine as soon as it runs (and a restarted one)
                self.bridge.set_prompt(self.controls.state.prompt)
            live = self.opts.mode == "live" or (self.opts.mode == "auto" and self.source.is_live)
            if live:
                self._run_live()
            else:
                self._wait_ready()
                self._report_style(refresh=True)
                self._run_lossless()
            if self._input_error is not None:
                raise self._input_error
            failed = False
        except (KeyboardInterrupt, StopRequested, Interrupted) as stop:  # Interrupted: a stop held in the bridge
            stopped_by, code = stop_outcome(stop, self.stops.signum)
            failed = False
            self._say_failure_under(stop)
        finally:
            # A second signal, Ctrl-C pressed again included, must not cut the finalising short: it stopped the
            # outputs after the first one, leaving their recordings unfinished under their hidden partial names.
            for signum in previous_handlers:
                signal.signal(signum, signal.SIG_IGN)
            self._close(keep=not failed, stopping=bool(stopped_by) or self.controls.state.quit)
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
        self._report(stopped_by)
        return code if stopped_by or not self._unfinished else EXIT_BAD_INPUT

    def _frames(self) -> Iterator[np.ndarray | None]:
        """Input frames fitted to the output size, until the end, `--frames`, or quit.

        With a live feed, None means that no frame came in time (the feed stalled): hold the picture."""
        limit = self.opts.max_frames
        while not self.controls.state.quit and (limit is None or self.frames_in < limit):
            self.stops.check()  # a stop signal held back while the bridge ran (this generator is pulled from it)
            self._poll_controls()
            if self.controls.state.quit:  # a quit just applied: no frame is read after it
                return
            if self.controls.state.paused:
                self._idle()
                continue
            try:
                frame = self._read()
            except PlayerError as exc:
                self._input_error = exc
                return
            self._holding = frame is None and self.feed is not None
            if self._holding:
                yield None
                continue
            if frame is None:
                self._input_ended = True
                return
            self.frames_in += 1
            frame = self._fit(frame)
            if self.control_input is not None:
                self._control = self.control_input.next()
            if self.web is not None:
                self.web.input_frame(frame)
            yield frame

    def _fit(self, frame: np.ndarray) -> np.ndarray:
        """The output size: a last odd row/column dropped; a frame scaled when `--size` asks for another
        size, or when the input changed resolution mid-stream (the picture stays whole rather than
        cropped to a corner)."""
        w, h = self.size
        as_opened = frame.shape[:2] == (self.source.height, self.source.width)
        if as_opened and not self._scaled:
            return frame[:h, :w]
        import cv2

        if not as_opened and frame.shape[:2] != self._last_input_shape:
            self.printer.say(f"{self.name}: the input changed size to {frame.shape[1]}x{frame.shape[0]}; "
                             f"scaled to the output's {w}x{h}")
            self._last_input_shape = frame.shape[:2]
        return cv2.resize(frame, (w, h), interpolation=cv2.INTER_AREA)

    def _read(self) -> np.ndarray | None:
        if self.feed is not None:
            for message in self.feed.messages():
                self.printer.say(f"{self.name}: {message}")
            return self.feed.next(1.0 / self.source.fps if self._holding else STALL_GRACE_S)
        try:
            frame = self.source.read()
            if frame is None and self.opts.loop and not self.source.is_live and self.frames_in > 0:
                self.source.close()
                self._open_source()
                frame = self.source.read()
        except MediaError as exc:
            raise PlayerError(f"input: {exc}") from None
        skipped = self.source.skipped_packets
        if skipped and not self._skipped_reported:
            self.printer.say(f"{self.name}: input: damaged data in {self.source.name}, skipped; the picture goes on")
        self._skipped_reported = skipped
        return frame

    def _run_lossless(self) -> None:
        """Every input frame through the engine as one stream, each output written as soon as it is back
        (the engine restyles the next frames meanwhile). If the engine crashes, the frames it had not
        answered go again, first, to the restarted one, so the output still has every frame."""
        known = [n for n in (self.opts.max_frames, self.source.frame_count) if n]
        total = min(known) if known and not self.opts.loop else None
        inputs = self._frames()
        unanswered: deque[np.ndarray] = deque()  # handed to the engine, output not back yet
        failures = 0
        self.printer.await_first(f"{self.name}: waiting for the first restyled frame")
        while True:
            outputs = self.bridge.process_stream(self._sent(inputs, unanswered),
                                                 stall_timeout_s=PROCESS_TIMEOUT_S + self.opts.startup_timeout_s,
                                                 control=self._sent_controls() if self.control_input else None)
            try:
                for out in outputs:
                    unanswered.popleft()
                    failures = 0
                    self._emit(out)
                    self.printer.progress(self.frames_out, total)
                    self._report_style()
                break
            except PlayerError:  # the last output failed (_drop_output): the run ends, the engine is fine
                raise
            except Exception as exc:  # the bridge's failures (engine died, timed out) all look alike here
                failures += 1
                self._retry_after(exc, failures, len(unanswered))
            finally:
                outputs.close()
        if not self.controls.state.quit and self._input_error is None:
            # The input ended: what was written is the whole (a container's frame count is only an estimate).
            self.printer.end_progress(final_total=self.frames_out)

    def _sent(self, inputs: Iterator[np.ndarray | None],
              unanswered: deque[tuple[np.ndarray, np.ndarray | None]]) -> Iterator[np.ndarray]:
        """The frames to send: those a crashed engine left unanswered first (they stay listed, with their
        control frames, until their outputs are back, so a second failure loses none either), then new
        ones, each listed as sent."""
        for frame, self._sent_control in list(unanswered):
            yield frame
        for frame in inputs:
            unanswered.append((frame, self._control))
            self._sent_control = self._control
            yield frame

    def _sent_controls(self) -> Iterator[np.ndarray | None]:
        """The control frame of each frame `_sent` hands over (the bridge takes one right after its frame)."""
        while True:
            yield self._sent_control

    def _retry_after(self, exc: Exception, failures: int, frames: int) -> None:
        self.stops.check()  # a stop held back in the bridge, which then failed: a stop, not a failure to retry
        _, status = self.bridge.latest()
        self._remember_log(status)
        if _is_failed(status) or failures >= MAX_FAILED_STARTS:
            raise self._engine_error(f"the engine failed while processing frames: {exc}", status) from None
        first = self.frames_out
        self.printer.say(f"{self.name}: the engine stopped ({exc}); frames {first}..{first + frames - 1} "
                         "go again once it has restarted")
        time.sleep(RETRY_PAUSE_S * failures)  # let the bridge finish its restart before asking again

    def _run_live(self) -> None:
        period = 1.0 / self.source.fps if self.source.fps else 0.0
        pace = not self.source.is_live  # a file played live runs at its own rate
        next_due = time.monotonic()
        ran = False
        if self.source.is_live:
            reopen = self._web_camera if self.opts.uses_web_camera else lambda: open_source(self.opts.input)
            self.feed = LiveFeed(self.source, reopen)
        for frame in self._frames():
            if frame is not None:
                if self.control_input is not None:
                    self.bridge.submit(frame, control=self._control)
                else:
                    self.bridge.submit(frame)
                if self.web is not None:
                    self.web.submitted(self.bridge.last_seq)
            out, status = self.bridge.latest()
            ran = ran or _is_ready(status)
            self._remember_log(status)
            self._follow_engine(status)
            # A show goes on through engine restarts (the fallback fills in), but an engine that
            # never came up, or cannot be started at all, ends the run with its reason.
            if _is_failed(status) or (not ran and status.restarts >= MAX_FAILED_STARTS):
                raise self._engine_error("the engine did not start", status)
            shown = frame if out is None else out
            if shown is None:  # the input stalled: the last picture again, so every output stays alive
                shown = self._last_out
            if shown is not None:
                self._emit(shown, status.seq)
                self.unrestyled_out += status.fallback
            stalled = self._stall_note() if self._holding else ""
            self._report_style()
            self.printer.update(live_line(self.frames_out, status, style=self.style.short) + stalled)
            if pace:
                next_due += period
                delay = next_due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:
                    next_due = time.monotonic()

    def _stall_note(self) -> str:
        """What the status line says while no input frame comes: for `loom web` before any page has sent its
        camera, that it waits for one (nothing is wrong yet)."""
        if self.opts.uses_web_camera and self.web is not None and self.web.camera.received == 0:
            return "  waiting for a page's camera (open the page's address above)"
        return "  input stalled: the last picture is held"

    def _emit(self, frame: np.ndarray, seq: int = -1) -> None:
        """Write one output frame everywhere; an engine frame of another size is fitted to the outputs.
        `seq`: the input it was restyled from, when known (the web page times the round trip with it)."""
        w, h = self.size
        if frame.shape[:2] != (h, w):
            import cv2

            frame = cv2.resize(frame, (w, h), interpolation=cv2.INTER_AREA)
        if frame.ndim == 3 and frame.shape[2] == 4:
            frame = frame[..., :3]
        frame = np.ascontiguousarray(frame, dtype=np.uint8)
        # A stop signal waits until every output has the frame and it is counted: raised as one file's write
        # returned, it left that frame in the file, missing from the others and from the report's count.
        with signals_deferred():
            for sink in list(self.sinks):
                try:
                    sink.write(frame)
                except MediaError as exc:
                    self._drop_output(sink, exc)
            self.frames_out += 1
        self._last_out = frame
        self._show(frame)
        if self.web is not None:
            self.web.output(frame, seq)

    def _drop_output(self, sink: Any, error: MediaError) -> None:
        """One output failed (a recording drive, a streaming server gone): the others, and the show, go on."""
        self.sinks.remove(sink)
        self._unfinished.append(sink.name)
        left = sink.discard()  # incomplete: a file's target keeps what it held before
        if not self.sinks and self.window is None and self.web is None:
            raise PlayerError(f"output: {error}{left}")
        self.printer.quiet = False  # errors are always shown
        self.printer.say(f"{self.name}: error: output: {error}{left}; this output is stopped, the others go on")

    def _show(self, frame: np.ndarray) -> None:
        if self.window is None:
            return
        s = self.controls.state
        lines: list[str] = []
        if s.overlay:
            _, status = self.bridge.latest()
            lines = [live_line(self.frames_out, status), f"prompt: {s.prompt}" + (f"  ({self.style.short})"
                                                                                   if self.style.short else "")]
            lines += [line for line in (s.settings_line(), s.message) if line]
        if self.keyboard.typing is not None:
            lines.append(f"new prompt> {self.keyboard.typing}_")
        self.keyboard.press(self.window.show(frame, lines, s.fullscreen))
        self._quit_if_window_closed()

    def _poll_window(self) -> None:
        """The window's keys while a write waits on a stream whose receiver takes nothing (open_sink's
        while_waiting): OpenCV's window is read on this thread only, so a `q` or Esc read between frames alone would
        wait for that write's stall limit; read here, it stops the outputs at once, as a quit over OSC does
        (Controls' on_quit)."""
        self.keyboard.press(self.window.poll_key())
        self._quit_if_window_closed()

    def _quit_if_window_closed(self) -> None:
        if self.window.closed_by_user():
            self.controls.state.quit = True
            self._stop_outputs()

    def _report_style(self, refresh: bool = False) -> None:
        """Say the style the engine's prompt landed on, once per prompt: at the start and after each change
        (keys, OSC, the prompt list alike). `refresh`: ask the engine now (a file run, between batches)."""
        now = time.monotonic()
        if not refresh and now - self._style_polled < STYLE_POLL_S:
            return
        self._style_polled = now
        line = self.style.update(self.bridge.engine_report(refresh), wanted=self.controls.state.prompt)
        if line is not None:
            self.printer.say(f"{self.name}: {line}")
            self.printer.set_postfix(self.style.short)
        self._say_engine_news()

    def _say_engine_news(self) -> None:
        """What the running engine refused (a prompt its embeddings file lacks) or reported, in its words,
        once each: the command itself was said when sent, and the engine stays running; with --standby, the
        standby's readiness and takeovers (`_say_standby`)."""
        stats = self.bridge.stats()
        errors = stats.get("errors", 0)
        if errors > self._errors_said and stats.get("last_error"):
            self.printer.say(f"{self.name}: {stats['last_error']}")
        self._errors_said = errors
        if self.opts.standby:
            self._say_standby(stats)

    def _say_standby(self, stats: dict[str, Any]) -> None:
        """With --standby: once a standby is ready beside the engine in use, and once it has taken over, said with
        both pids (a performer knows the show is covered, and which process is which)."""
        engine, standby = stats.get("engine_pid"), stats.get("standby") or {}
        ready = standby.get("pid") if standby.get("state") == "ready" else None
        said_engine, said_ready = self._standby_said
        if said_ready is not None and engine == said_ready:
            self.printer.say(f"{self.name}: the standby engine (pid {engine}) took over from pid {said_engine}; "
                             "a new standby is loading")
            said_ready = None
        if ready is not None and ready != said_ready and engine is not None:
            self.printer.say(f"{self.name}: standby engine ready (pid {ready}; the engine in use is pid {engine}): "
                             "it takes over at once if that one stops")
            said_ready = ready
        self._standby_said = (engine, said_ready)

    def _poll_controls(self) -> None:
        for line in self.controls.apply_pending(self.bridge):
            self.printer.say(f"{self.name}: {line}")

    def _idle(self) -> None:
        """Paused: keep the window responsive and the controls flowing, read nothing."""
        if self.window is not None and self._last_out is not None:
            self._show(self._last_out)
        time.sleep(PAUSE_POLL_S)

    def _follow_engine(self, status: Any) -> None:
        """Prompts and parameters sent live (keys, OSC, the page) are refused in the words of the running engine's
        model family, and for parameters it does not take, once it has said them; a family that is not the
        config's (a served engine's) is said once, and a served engine's starting settings are taken once."""
        if not _is_ready(status):
            self._followed = False  # a restarted or reconnected engine says its settings again when ready
            return
        if self._followed:  # read once per ready engine, not every frame
            return
        self._followed = True
        start = self.bridge.engine_start()
        if self.controls.follow_engine(start) and (family := self.controls.state.family) != self.opts.family:
            self.printer.say(f"{self.name}: the engine runs the {family} model family, not the {self.opts.family} "
                             f"family of -c {self.opts.config}: its prompt is {PROMPT_TAKES[family]}")
        if self.opts.endpoint and not self._took_start:
            self._take_start(start)

    def _take_start(self, start: dict[str, Any] | None) -> None:
        """A served engine runs its own config: the controls take what it started on where the command line set
        nothing (-p, --set, --lora, --control), and it is told what the command line set; said once where that is
        not -c's, and for what it does not take."""
        self._took_start = True
        o = self.opts
        if start is not None:
            self._check_served_control(start)
        taken, unsent = self.controls.take_start(start, self.bridge, prompt_given=bool(o.prompts),
                                                 given=o.given_params, control_frames=o.control_input is not None)
        if o.reference is not None:  # read here and sent, as the r key does: a served engine reads only its config's
            self.controls.put(Command("reference", (o.reference,)))
        if taken:
            said = ", ".join(f"{name} {value!r}" for name, value in taken.items())
            self.printer.say(f"{self.name}: the engine started on its own settings, not those of -c {o.config}: "
                             f"{said}; the controls follow it (-p and --set choose others)")
        if unsent:
            takes = ", ".join(sorted(self.controls.state.takes or ()))
            self.printer.say(f"{self.name}: the engine does not take {', '.join(unsent)}: not sent (it takes {takes})")

    def _check_served_control(self, start: dict[str, Any]) -> None:
        """--control, --control-input and --reference, checked against the structure control a served engine says
        it has, not against -c's (whose model is not the engine's), before anything is sent to it: one it cannot
        take ends the run (exit code 2), naming what it takes. An engine that does not say is sent them as they are."""
        o = self.opts
        sources = served_sources(start, o.control_input is not None)
        source = o.given_params.get(CONTROL.name)
        option = "--control-input" if o.control_input else f"--control {source}" if o.control else \
            f"--set {CONTROL.section}.{CONTROL.name}={source}"
        vace = "serve a *vace* preset (loom serve -c wan2.1-vace-1.3b, or tiny-vace on a CPU)"
        if sources == () and (source is not None or o.reference is not None):
            given = [option] if source is not None else []
            given += ["--reference"] if o.reference is not None else []
            raise PlayerError(f"{' and '.join(given)}: the served engine's model has no VACE control blocks and reads "
                              f"no edges; {vace}")
        if sources and source is not None and source not in sources:
            depth = " (depth needs a depth model: control.depth_model in its config)" if source == "depth" else ""
            raise PlayerError(f"{option}: the served engine cannot make control source {source!r}; it takes "
                              f"{', '.join(sources)}{depth}")
        if sources and o.reference is not None and start.get("takes_reference") is False:
            raise PlayerError(f"--reference: the served engine's model reads its input's edges only and takes no "
                              f"reference image; {vace}")

    def _remember_log(self, status: Any) -> None:
        self._log_tail = list(status.log_tail) or self._log_tail
        self._last_error = self.bridge.stats().get("last_error") or self._last_error

    def _engine_error(self, what: str, status: Any, hint: str = "") -> PlayerError:
        """`what` failed, with the engine's last message and log lines; `hint`: what the user can change."""
        if status.refusal:  # the engine refused the run (config, weights, this host's secret): the user's to fix, once
            return PlayerError(status.refusal, EXIT_BAD_INPUT)
        self._remember_log(status)
        message = status.message
        if not message or message in what:
            text = what
        elif message.startswith("the engine could not start"):  # the bridge's words say it all
            text = message
        else:
            text = f"{what}: {message}"
        text = f"{text} ({hint})" if hint else text
        lines = [*self._log_tail, self._last_error] if self._last_error else self._log_tail
        return PlayerError(text, EXIT_ENGINE_FAILED, detail="\n".join(lines))

    # --- tear-down ---------------------------------------------------------------------------

    def _stop_outputs(self) -> None:
        """The user quit (on any thread: see Controls): a write to a stream whose receiver takes nothing gives up
        now, not after its stall timeout, as a Ctrl-C held back by signals_deferred makes it (FrameSink.stop)."""
        for sink in list(self.sinks):
            sink.stop()

    def _interrupt_bridge(self) -> None:
        """End the bridge's wait in progress: a stop signal came while the main thread was in it (StopSignals)."""
        if self.bridge is not None:
            self.bridge.interrupt()

    def _say_failure_under(self, stop: BaseException) -> None:
        """Say the failure a stop signal was delivered over (signals_deferred holds one back while the last output
        fails): the run ends as stopped, and the user still hears why that output stopped."""
        if isinstance(stop.__context__, PlayerError):
            self.printer.quiet = False  # errors are always shown
            self.printer.say(f"{self.name}: error: {stop.__context__}")

    def _close(self, keep: bool, stopping: bool) -> None:
        """Finalise outputs first (they matter most), then stop the engine, OSC, window and input.

        `keep`: the run ended normally or was stopped by the user, so the files written so far replace
        their targets. After a failure a target that existed is left as it was; a new one gets the
        frames written before the failure (finalised, so they play) rather than nothing. `stopping`: the
        user stopped the run, so a network output whose receiver takes nothing is not waited on for long; cut off
        so (StreamCutOff), it is said as Ctrl-C says it, and a quit still ends with exit code 0 (`_cut_off`)."""
        self.printer.end_progress()  # the bar where it stands, or the wait for a first frame that never came
        for sink in self.sinks:
            try:
                sink.close(keep=keep or (not sink.is_network and not Path(sink.name).exists()), stopping=stopping)
            except Exception as exc:  # every output gets its turn; a lost one is reported, not hidden
                cut_off = isinstance(exc, StreamCutOff)
                (self._cut_off if cut_off else self._unfinished).append(sink.name)
                self.printer.quiet = False  # errors are always shown
                self.printer.say(f"{self.name}: {'output cut off at the stop' if cut_off else 'error: output'}: {exc}")
        if not keep:  # a failed run has no last line (_report) to say where its file went
            for sink in self._kept_aside():
                self.printer.quiet = False  # as errors are
                self.printer.say(f"{self.name}: this run's output is {sink.written_to}")
        for thing in (self.bridge, self.osc, self.window, self.web, self.feed or self.source, self.control_input):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()

    def _kept_aside(self) -> list[Any]:
        """The file outputs that went beside their target, a file having been saved there during the run
        (FrameSink.kept_at): said once, in the run's last line (a quiet run's too), or after a failure by `_close`;
        the user must not look for the run's file where it is not."""
        return [sink for sink in self.sinks if sink.kept and sink.written_to != sink.name]

    def _report(self, stopped_by: str) -> None:
        if self.source is None:
            return
        elapsed = time.monotonic() - self._started
        written = ", ".join(s.written_to for s in self.sinks if s.name not in self._unfinished + self._cut_off and
                            (s.is_network or s.kept)) or ("the window" if self.window is not None else
                                                          "the web page" if self.web is not None else "no output")
        how = f"stopped by {stopped_by}; " if stopped_by else ""
        w, h = self.size
        damaged = f" ({self._skipped_reported} damaged input packets skipped)" if self._skipped_reported else ""
        c = self.control_input
        control = f"; control frames: {c.sent} sent, {c.missing} without (grey)" if c is not None else ""
        unrestyled = f"; {self.unrestyled_out} unrestyled, the input shown while the engine started or restarted" \
            if self.unrestyled_out else ""
        self.printer.finish(f"{self.name}: {how}{self.frames_out} frames ({w}x{h}, {self.source.fps:g} fps"
                            f"{unrestyled}) to {written} in {elapsed:.1f} s{damaged}{control}")
        stated = self.source.frame_count
        if self._input_ended and not self.opts.loop and not self.source.is_live and stated and \
                stated - self.frames_in > max(SHORT_INPUT_FRAMES, SHORT_INPUT_SHARE * stated):
            # A file cut short decodes to its end without an error: the run would look complete. A result a
            # script needs, so printed as the last line is, -q or not.
            self.printer.finish(f"{self.name}: input ended after {self.frames_in} of the {stated} frames its "
                                "header states (a file cut short?)")


def _is_ready(status: Any) -> bool:
    return status.state == EngineState.RUNNING


def _is_failed(status: Any) -> bool:
    return status.state in (EngineState.DEAD, EngineState.STOPPED)


def run_player(options: PlayerOptions) -> int:
    """Run the player; every user-fixable failure is one message on stderr and an exit code."""
    printer = StatusPrinter(quiet=options.quiet)
    try:
        return Player(options, printer).run()
    except PlayerError as exc:
        printer.quiet = False  # errors are always shown
        printer.say(f"{options.command}: error: {exc}")
        if exc.detail:
            printer.say("engine log (last lines):\n" + exc.detail.rstrip())
        return exc.exit_code
    except KeyboardInterrupt:
        printer.quiet = False
        printer.say(f"{options.command}: interrupted")
        return EXIT_INTERRUPTED
