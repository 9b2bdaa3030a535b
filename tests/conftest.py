"""Load the repository as a package, the way ComfyUI loads a custom node pack.

ComfyUI has its own top-level `nodes` module, so the pack's `nodes/` is only ever imported relatively,
from inside the package. Tests import it as `kv_offload_pack.nodes.<module>`.
"""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACK = "kv_offload_pack"


def load_pack():
    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    return sys.modules[PACK]


load_pack()
