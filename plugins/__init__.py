"""Built-in kvforge plugins. Loaded only through the `kvforge.plugins` entry points."""
