"""_data"""
