"""zorro's tests, in folders by layer. A regular package, so that `tests.<layer>.<module>` (the names pytest's
importlib mode gives test modules, which spawned ranks import by name) is never another distribution's
top-level `tests` package (verl and OpenRLHF install one)."""
