"""Building a scorer: this host's platform decisions (platform, bitclasses), compile targets (targets), the
executable store (store), the compiled programs (executables) placed on a mesh (sharding), composed into a scorer
(compose, startup) whose service model is measured at start (calibration). Imports the shapes and the requests."""
