"""Console screens: one module per screen; each is a Textual mode the app switches between."""
