"""The three context levels as strategies: what a worker prepares, and what a task gets.

| level | prepared once per worker | each task gets |
|---|---|---|
| ``full`` | the template copied to local disk, the context built and kept | the resident context |
| ``partial`` | the template copied to local disk | a context built from that copy |
| ``agnostic`` | nothing | a context built from the source (one source read) |

:meth:`Level.fetch` runs outside the host's load slot (a copy waits on the network);
:meth:`Level.prepare` inside it (it reads disks and fills memory); :meth:`Level.take` in
the task's thread.

A context without files (``template=None``) copies nothing at any level: ``partial`` and
``agnostic`` then both build the context for each task from nothing but the loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_pcm.loaders.model import build_for_one_task

if TYPE_CHECKING:
    from dask_pcm.worker.plugin import ContextPlugin


class Level:
    """What one level does; see the module docstring."""

    name = ""
    resident = False  # whether a built context is kept between tasks

    def fetch(self, plugin: ContextPlugin) -> None:
        """Copy the template to local disk where this level keeps it (peers, else source)."""
        if plugin.manifest is not None:
            plugin.template.copy()

    def prepare(self, plugin: ContextPlugin) -> None:
        """Work under the host's load slot once the template is local."""

    def take(self, plugin: ContextPlugin, resident: Any) -> tuple[Any, bool]:
        """The object for one task, and whether the task owns it (releases it after)."""
        with build_for_one_task():
            return plugin.holder.build(), True


class Full(Level):
    name = "full"
    resident = True

    def prepare(self, plugin: ContextPlugin) -> None:
        # Room first, for what the context took last time or, at its first load, what the
        # loader expects (CausalLM: the weights on disk); once built, again for its real size.
        plugin.make_room(plugin.holder.expected_bytes())
        plugin.holder.keep(plugin.holder.build())

    def take(self, plugin: ContextPlugin, resident: Any) -> tuple[Any, bool]:
        return resident, False


class Partial(Level):
    name = "partial"

    def fetch(self, plugin: ContextPlugin) -> None:
        if plugin.template.has_files:
            plugin.template.copy()  # with no manifest from the client (a hub id), from the source


class Agnostic(Level):
    name = "agnostic"

    def fetch(self, plugin: ContextPlugin) -> None:
        pass  # nothing is kept: every build reads the source

    def prepare(self, plugin: ContextPlugin) -> None:
        plugin.template.measure_source()

    def take(self, plugin: ContextPlugin, resident: Any) -> tuple[Any, bool]:
        plugin.template.read_source()
        with build_for_one_task():
            return plugin.holder.build(), True


LEVELS: dict[str, Level] = {level.name: level for level in (Full(), Partial(), Agnostic())}
