"""Drop-in use of tierckpt from training frameworks: one module per framework, importing it only inside."""
