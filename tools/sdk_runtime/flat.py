"""The seed's flat style, shipped as ``ptc_tools/_flat.py``. Standard library only.

``tools.list_files(path=".")`` calls the one tool named ``list_files`` among the job's toolsets,
whichever toolset has it; ``await tools.list_files.aio(...)`` from asyncio. A name that two granted
toolsets both have is a ``ToolError`` with code ``ambiguous_tool`` naming them: call it through its
toolset's class then (``from ptc_tools.fs import Fs; Fs.list_files(...)``). The names come from
``_catalog.json``, the same definitions the toolset modules were generated from.

The runner puts ``tools`` in the code's globals; ``from ptc_tools import tools`` works too.
"""

from typing import Any

from ptc_tools import _discovery, _runtime


class FlatTool:
    """One tool, called by its bare name: ``tools.add(a=1, b=2)``."""

    def __init__(self, toolset: str, name: str) -> None:
        self.toolset = toolset
        self.name = name

    def __call__(self, **arguments: Any) -> Any:
        return _runtime.call(self.toolset, self.name, arguments)

    async def aio(self, **arguments: Any) -> Any:
        return await _runtime.acall(self.toolset, self.name, arguments)

    def __repr__(self) -> str:
        return f"<tool {self.toolset}.{self.name}>"


class Tools:
    """Every granted tool by its bare name. ``dir(tools)`` lists them."""

    def __getattr__(self, name: str) -> FlatTool:
        if name.startswith("__"):
            raise AttributeError(name)
        found = [t for t in _discovery._tools() if t["name"] == name]
        if len(found) == 1:
            return FlatTool(found[0]["toolset"], name)
        if found:
            where = ", ".join(f"{t['toolset']} ({t['class']}.{name})" for t in found)
            raise _runtime.ToolError(
                f"'{name}' is in several granted toolsets: {where}; call it through its toolset's class",
                tool=name,
                code="ambiguous_tool",
            )
        raise AttributeError(f"no granted tool is named {name!r}; ptc_tools.search({name!r}) finds close ones")

    def __dir__(self) -> list[str]:
        return sorted({t["name"] for t in _discovery._tools()})

    def __repr__(self) -> str:
        return f"<tools: {', '.join(self.__dir__())}>"


tools = Tools()
