"""One small registry type behind every name → thing table (layers, models, datasets, strategies, tasks)."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names mapped to entries, in registration order; lookups of unknown names raise `error`.

    `load`, if given, is called once, before the first lookup, listing or count (not before add): it imports the
    modules that register the entries (fedge.plugins.load_methods), so importing the registry imports no method."""

    def __init__(self, kind: str, error: type[Exception], load: Callable[[], object] | None = None) -> None:
        self.kind, self.error = kind, error
        self.entries: dict[str, T] = {}
        self._load = load

    def _loaded(self) -> dict[str, T]:
        if self._load is not None:
            load, self._load = self._load, None  # first: a module it imports may read this registry
            try:
                load()
            except BaseException:
                self._load = load  # the next lookup tries again and raises the same error
                raise
        return self.entries

    def add(self, name: str, entry: T) -> T:
        """Register `entry`; a duplicate name is a programming error (ValueError)."""
        if name in self.entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self.entries[name] = entry
        return entry

    def remove(self, name: str) -> T:
        """Take an entry out again (a plugin's or a test's); an unknown name raises self.error."""
        entry = self.get(name)
        del self.entries[name]
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of add()."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:
        """The entry for `name`; an unknown name raises self.error listing the known ones."""
        entries = self._loaded()
        try:
            return entries[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; available: {', '.join(entries)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._loaded()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())
