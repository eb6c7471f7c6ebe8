"""Models and data sets: the bundled ones and ``pkg.module:attr`` plug-ins."""
