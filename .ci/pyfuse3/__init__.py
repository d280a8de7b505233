"""pyfuse3 with olliefs's patches: the build script and the patches it applies, shipped
as package data (``ollie build-pyfuse3``, ``.ci/setup``)."""
