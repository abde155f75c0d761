"""The Loom player: `loom play` (file, camera or stream in; window, file or stream out; live control).

A thin host on top of `host_bridge`: it reads frames with `plugin.media.sources`, exchanges them
with an engine process through `host_bridge.Bridge`, and writes the results. No diffusion here.
"""

from loom_live.plugin.player.app import Player, run_player
from loom_live.plugin.player.options import PlayerError, PlayerOptions, read_prompt_file

__all__ = ["Player", "PlayerError", "PlayerOptions", "read_prompt_file", "run_player"]
