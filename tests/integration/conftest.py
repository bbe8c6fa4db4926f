"""End-to-end tests through a real SGLang server (``tests.support.server``): each module
starts its own server in a subprocess, or shares one across its tests. Unit tests of each
package live beside it (tests/http, tests/engine, tests/binding, tests/cli, ...)."""
