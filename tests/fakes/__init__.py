"""Stand-ins and harnesses the tests share: fake host applications (TouchDesigner, ComfyUI), a fake
CUDA runtime, in-process engines, and generated media. Test modules import from here, never from
each other."""
