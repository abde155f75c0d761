"""Audio of a file input carried into a file output beside the restyled video.

Packets are copied where the output's container takes the codec and re-encoded to AAC where it does not, cut
where the video ends and aligned to the input's first video frame (``AudioPassThrough``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom_live.plugin.media.base import MediaError, reason

# Audio codecs an MP4 muxer accepts on paper but most players cannot play: re-encoded to AAC.
MP4_REENCODE_AUDIO_PREFIXES = ("pcm_", "vorbis")


class AudioPassThrough:
    """Copies the first audio stream of a file into the output as the video advances.

    Packets are copied when the output container accepts the codec and re-encoded to AAC
    otherwise. Audio is cut where the video ends (a run stopped early stays in sync) and is
    aligned to the source's first video frame.
    """

    def __init__(self, output: Any, source: Path, out_suffix: str):
        import av

        self._input = av.open(str(source))
        self._stream = self._input.streams.audio[0]
        codec = self._stream.codec_context.name
        copy = codec in output.supported_codecs and not (
            out_suffix == ".mp4" and codec.startswith(MP4_REENCODE_AUDIO_PREFIXES))
        if copy:
            self._out = output.add_stream_from_template(self._stream)
            self._encoder = None
        else:
            # AAC needs a named channel layout; more than two channels are mixed down to stereo.
            layout = "mono" if self._stream.codec_context.layout.nb_channels == 1 else "stereo"
            self._out = output.add_stream("aac", rate=self._stream.codec_context.sample_rate, layout=layout)
            self._encoder = self._out
        self._output = output
        video = self._input.streams.video
        origin = video[0].start_time * video[0].time_base if video and video[0].start_time else 0
        self._origin_s = float(origin)
        self._packets = self._input.demux(self._stream)
        self._held: Any = None
        self._exhausted = False

    def copy_until(self, until_s: float) -> None:
        """Move every source packet that starts before ``until_s`` (output time) to the output."""
        while not self._exhausted:
            packet = self._held or next(self._packets, None)
            self._held = None
            if packet is None:
                self._exhausted = True
                return
            if packet.pts is None or packet.size == 0:
                continue
            source_s = float(packet.pts * packet.time_base)
            start_s = source_s - self._origin_s
            if start_s >= until_s:
                self._held = packet
                return
            if start_s < 0 <= source_s:
                continue  # audio from before the first video frame (codec priming, pts < 0, stays)
            self._emit(packet)

    def _emit(self, packet: Any) -> None:
        if self._encoder is None:
            shift = round(self._origin_s / packet.time_base)
            packet.pts -= shift
            if packet.dts is not None:
                packet.dts -= shift
            packet.stream = self._out
            self._output.mux(packet)
            return
        for frame in packet.decode():
            frame.pts = None  # the encoder numbers its own samples from 0
            self._output.mux(self._encoder.encode(frame))

    def finish(self, end_s: float) -> None:
        self.copy_until(end_s)
        if self._encoder is not None:
            self._output.mux(self._encoder.encode(None))

    def close(self) -> None:
        self._input.close()


def audio_file(audio_from: str | int | Path | None) -> Path | None:
    """The file to take audio from, or None when ``audio_from`` is not a file with audio."""
    import av

    if audio_from is None or isinstance(audio_from, int) or "://" in str(audio_from) \
            or str(audio_from).strip().isdigit():
        return None
    path = Path(audio_from)
    if not path.is_file():
        raise MediaError(f"audio source not found: {path}")
    try:
        with av.open(str(path)) as probe:
            return path if probe.streams.audio else None
    except (av.error.FFmpegError, OSError) as e:
        raise MediaError(f"audio source {path}: cannot open: {reason(e)}") from e
