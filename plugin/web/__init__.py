"""The browser host: a web page beside a player run (`loom play --web`), or the browser's camera
restyled and sent back to it (`loom web`), over WebRTC, on the same bridge and engine as every host.

access.py checks who may open the page; server.py serves it (aiohttp) on its own thread;
tracks.py moves video over WebRTC (aiortc); camera.py makes the page's camera a player input;
stamp.py marks frames so the page can time glass to glass; page_controls.py turns the page's
messages into the player's commands; host.py ties them to the player. The page itself is plain
HTML and JavaScript in static/ (no build step). Needs the `web` extra (aiohttp, aiortc); this
package imports nothing, so the parts that need neither load without them.
"""
