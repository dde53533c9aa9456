from lorapop.cli import app

app()
