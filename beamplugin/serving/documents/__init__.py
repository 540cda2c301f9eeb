"""Documents rather than lines: a text or an HTML page cut into the sentences the model
translates, each sent to the engine as a request of its own, and the translations put back in
the input's shape. :mod:`.sentences` finds the sentences, :mod:`.document` puts a document back
together, :mod:`.markup` reads HTML, :mod:`.translation` sends a request's documents through
the server's admission."""
