"""Images in (issue 44), frontend side: media loading, the image processors, the renderer pool."""
