"""_engines"""
