"""The Loom TouchDesigner component's Python: extension, Script TOP, Parameter Execute and OSC In callbacks.

TouchDesigner loads these files as DATs (see README.md in this folder); the package form lets
tests, and a TouchDesigner whose module path holds the Loom folder, import them as well.
"""
