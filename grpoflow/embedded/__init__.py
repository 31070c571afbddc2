"""Offline stand-ins for the production parts, real software too: a CPU engine that speaks SGLang's HTTP API
(`engine`) and a bubblewrap sandbox plugged into Harbor as a custom environment (`sandbox`). Production runs SGLang
and a cloud sandbox instead; nothing outside this package depends on its internals."""
