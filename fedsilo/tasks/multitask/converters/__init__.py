"""The converters, one module per family of sources; `load_all()` imports them all, which fills
`catalog.CATALOG` (a module added here is found without an edit)."""
import importlib
import pkgutil


def load_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
